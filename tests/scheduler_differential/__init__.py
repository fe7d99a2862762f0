"""Differential harness for vLLM's scheduler-side aux-output connector
(``AuxOutputSchedulerConnector``): see harness.py."""

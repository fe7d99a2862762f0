"""The worker connector differential: vLLM's connector with vLLM's store, and with aostore's.

See test_differential.py; run.py runs it in both vLLM environments."""

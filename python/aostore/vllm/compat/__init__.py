"""The drop-in checker: whether a class of vLLM's store package can be swapped for another.

It knows vLLM's names and nothing of aostore: every check takes the classes it compares as
arguments, so it can be tested on plain classes (tests/plugin/test_plugin_compat.py).
``fingerprint`` recognizes a release CI proves, ``usage`` and ``hazards`` read what vLLM's code
does with the classes, ``references`` finds what a swap cannot rebind, ``surface`` and
``compare`` compare two classes by names, kinds and signatures, and ``differential`` by
behaviour. docs/vllm-plugin.md says how the plugin uses them.
"""

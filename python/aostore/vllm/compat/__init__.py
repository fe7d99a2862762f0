"""The drop-in checker: whether a class of vLLM's store package can be swapped for another.

It knows vLLM's names and nothing of aostore: every check takes the classes it compares as
arguments, so it can be tested on plain classes (tests/plugin/test_plugin_compat.py).
``releases`` holds one record per vLLM release CI proves (per feature, its files and their
hashes, and its layout), ``fingerprint`` recognizes a release's store package, ``usage`` and
``hazards`` read what vLLM's code does with the classes, ``references`` finds what a swap
cannot rebind, ``surface`` and ``compare`` compare two classes by names, kinds and signatures,
and ``differential`` by behaviour. docs/vllm-plugin.md says how the plugin uses them.
"""

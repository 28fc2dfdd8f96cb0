"""The shim under which vLLM's own server tests (``tests/entrypoints/``, ``tests/tool_use/`` of its source
package) run against ``pagedllm serve``: ``plugin.py`` (the pytest plugin: the stand-in modules, the outcome of
each test), ``remote.py`` (what those tests import from vLLM's ``tests/utils.py``: ``RemoteOpenAIServer`` starting
``pagedllm serve``), ``translate.py`` (vLLM's serve flags and test models onto ours), ``fake_vllm.py`` (the few
``vllm.*`` names a server test imports; the rest of vLLM is absent, so a test of its internals is not collected).
Driven by ``benchmarks/vllm_server_tests.py``."""

"""The shim's stand-in for a vLLM launched as a process (see entrypoints/openai/api_server.py)."""

"""``python -m vllm.entrypoints.openai.api_server --model M ARGS``, as some of vLLM's tests start vLLM themselves
(tests/entrypoints/rl/conftest.py): the command line translated as ``RemoteOpenAIServer``'s (translate.py), then
this process becomes ``pagedllm serve`` (exec: the test's terminate() reaches the server itself). A command line
the shim refuses exits 2 naming what is missing, as a server that cannot start. vLLM's variables the server reads
(VLLM_SERVER_DEV_MODE) are in this process's environment already."""
from __future__ import annotations

import os
import sys

from vllm_shim.translate import Refused, translate


def main(argv: list[str]) -> None:
    args, host, port = [], "127.0.0.1", "8000"
    model = None
    it = iter(argv)
    for token in it:
        name, eq, value = token.partition("=")
        if name in ("--model", "--host", "--port"):
            value = value if eq else next(it, "")
            if name == "--model":
                model = value
            elif name == "--port":
                port = value
            continue
        args.append(token)
    if model is None:
        sys.exit("the shim's vllm api_server needs --model")
    try:
        command = translate(model, args)
    except Refused as e:
        sys.exit(f"pagedllm serve cannot stand in: {e.reason}")
    os.execv(sys.executable, [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", command.model, "--host",
                              host, "--port", port, "--uvicorn-log-level", "warning", *command.args])


if __name__ == "__main__":
    main(sys.argv[1:])

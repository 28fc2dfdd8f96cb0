"""The ``pagedllm`` command: ``generate``, ``serve``, ``run-batch``, ``chat``, ``complete``, ``models``, ``bench``,
``plan`` and ``build-kernels``."""
from __future__ import annotations

import argparse
import logging
import sys

from pagedllm.engine import local_core
from pagedllm.entrypoints import build_kernels
from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from
from pagedllm.errors import ValidationError
from pagedllm.platform.process import exit_now

SERVE_DEFAULTS: dict[str, object] = {"step_time_target": 0.8}
"""EngineArgs defaults of `pagedllm serve` that differ from LLM's, as vLLM's server and LLM class schedule
differently (its UsageContext): a server keeps its decoding streams' gaps bounded while long prompts prefill
(0.8 s: a stream's gap is a step, its delivery and the estimate's error; 1.0 gave 1.08 s, docs/BENCHMARKS.md)."""


def _generate(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(n=ns.n, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
                            max_tokens=ns.max_tokens, stop=ns.stop, ignore_eos=ns.ignore_eos,
                            seed=ns.sampling_seed, logprobs=ns.logprobs)
    llm = LLM(**vars(engine_args_from(ns)))
    if ns.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompts], params)
    else:
        outputs = llm.generate(ns.prompts, params)
    for prompt, out in zip(ns.prompts, outputs):
        for completion in out.outputs:
            print(f"--- prompt: {prompt!r} [{completion.index}] finish_reason={completion.finish_reason}")
            print(completion.text)
    return 0


def _models(ns: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import supported_models

    features = ("gguf", "tensor_parallel", "pipeline_parallel", "sliding_window", "moe", "lora")
    print("| architecture | families | " + " | ".join(features) + " |")
    print("|---|---|" + "---|" * len(features))
    for name, entry in sorted(supported_models().items()):
        marks = " | ".join("yes" if getattr(entry, f) else "-" for f in features)
        print(f"| {name} | {entry.families} | {marks} |")
    return 0


def _serve(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server

    return run_server(ns, engine_args_from(ns))


def _launch_render(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run_render_server

    return run_render_server(ns, engine_args_from(ns))


def _add_launch(sub: argparse._SubParsersAction) -> None:
    """`pagedllm launch render` (vLLM's `vllm launch render`): the serve command's flags, no engine."""
    from pagedllm.entrypoints.openai.api_server import add_serve_args

    launch = sub.add_parser("launch", help="servers of a disaggregated deployment")
    render = launch.add_subparsers(dest="launch_command", required=True).add_parser(
        "render", help="a render-only server: render, derender and tokenizer routes from the model's configuration "
                       "and tokenizer (no weights loaded, no KV cache, nothing generated)")
    add_serve_args(render)
    add_engine_args(render)
    render.set_defaults(**SERVE_DEFAULTS)
    render.set_defaults(func=_launch_render)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: LLM inference with PagedAttention")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts given on the command line")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--stop", action="append", default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--logprobs", type=int, default=None)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)
    models = sub.add_parser("models", help="list the supported model architectures and what each supports")
    models.set_defaults(func=_models)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           epilog="The engine core (scheduler, KV cache, model) runs in a process of its own; "
                                  "PAGEDLLM_ENABLE_MULTIPROCESSING=0 runs it as a thread of the server instead.")
    from pagedllm.entrypoints.openai.api_server import add_serve_args

    add_serve_args(serve)
    serve_actions = add_engine_args(serve)
    for name, value in SERVE_DEFAULTS.items():  # before set_defaults, which changes action.default
        action = serve_actions[name]
        action.help = (action.help or "").replace(f"(default: {action.default})", f"(default: {value})")
    serve.set_defaults(**SERVE_DEFAULTS)
    serve.set_defaults(func=_serve)
    _add_launch(sub)
    build_kernels.add_parser(sub)
    from pagedllm.entrypoints import cli_clients, run_batch

    run_batch.add_parser(sub)
    cli_clients.add_parsers(sub)
    from pagedllm.entrypoints.bench import plan

    plan.add_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from pagedllm.entrypoints.bench import latency, memory, perplexity, throughput
    from pagedllm.entrypoints.bench import serve as bench_serve

    throughput.add_parser(bench_sub)
    latency.add_parser(bench_sub)
    bench_serve.add_parser(bench_sub)
    memory.add_parser(bench_sub)
    perplexity.add_parser(bench_sub)
    return parser


def _configure_logging() -> None:
    """pagedllm's INFO messages (KV pool size, attention backend, kernel build) on stderr."""
    log = logging.getLogger("pagedllm")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def _prestart_core(argv: list[str]) -> None:
    """`pagedllm serve`: start the engine core process before this one imports the server (engine/local_core.py),
    unless the core runs as a thread (PAGEDLLM_ENABLE_MULTIPROCESSING=0; a bad value is the server's error to
    report) or only the help is asked for."""
    if argv[:1] != ["serve"] or {"-h", "--help"} & set(argv):
        return
    from pagedllm import envs

    try:
        if not envs.ENABLE_MULTIPROCESSING.read():
            return
    except ValidationError:
        return
    local_core.prestart()


def main(argv: list[str] | None = None) -> int:
    _configure_logging()
    argv = sys.argv[1:] if argv is None else list(argv)
    _prestart_core(argv)
    try:
        ns = build_parser().parse_args(argv)
        return ns.func(ns)
    except ValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        local_core.release()  # a core started first that the server did not take (an error, another mode)


def entry() -> None:
    """The `pagedllm` command (pyproject's [project.scripts]): main's status; a server, once it has shut down
    (its engine core stopped, its socket file removed), exits without the interpreter's teardown (~1 s)."""
    code = main()
    if sys.argv[1:2] in (["serve"], ["launch"]):
        exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()

"""``pagedllm run-batch``: vLLM's ``vllm run-batch``. Reads an OpenAI batch file (JSON lines of
``{"custom_id", "method": "POST", "url", "body"}``), runs every line through the server's own app in this process
(the same routes, checks, limits and error bodies as ``pagedllm serve``: each line is a request to it, over an
in-process ASGI transport, no socket) and writes OpenAI batch output lines in input order:
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``. A line that fails (bad JSON,
an unsupported url, a request the server refuses) gets its error in its own output line; the others run."""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import IO, Any

from pagedllm.entrypoints.cli_args import SubParsers, add_engine_args, engine_args_from
from pagedllm.errors import ValidationError, quoted

logger = logging.getLogger("pagedllm.run_batch")

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages",
              "/v1/chat/completions/batch", "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank",
              "/classify", "/pooling", "/invocations")
"""The routes a batch line may name (vLLM's, with this server's Responses and Messages APIs)."""


def add_parser(sub: SubParsers) -> None:
    """The ``run-batch`` command: the batch files, then every `pagedllm serve` and engine flag."""
    from pagedllm.entrypoints.openai.api_server import add_serve_args

    parser = sub.add_parser("run-batch", help="run an OpenAI batch file (JSON lines) offline, as `vllm run-batch`",
                            description="Run each request of an OpenAI batch file through this server's own "
                                        "endpoints, in this process, and write OpenAI batch output lines.")
    parser.add_argument("-i", "--input-file", required=True, metavar="PATH",
                        help="the batch file: a local path, or an http(s) URL to download it from")
    parser.add_argument("-o", "--output-file", required=True, metavar="PATH",
                        help="where the output lines go (a local path), in the input's order")
    parser.add_argument("--max-inflight", type=int, default=None, metavar="N",
                        help="requests running at once (default: twice --max-num-seqs, at least 64); finished ones "
                             "wait in memory for the slowest before them, as output is written in input order")
    add_serve_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=run_batch)


def run_batch(ns: argparse.Namespace) -> int:
    """Load the engine, build the server's app, run the file through it; returns the exit status (0 also when
    some lines failed: their errors are in the output)."""
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import app_from_args, engine_core_process, server_setup
    from pagedllm.entrypoints.openai.metrics import ServerMetrics

    if ns.output_file.startswith(("http://", "https://")):
        raise ValidationError("--output-file must be a local path (uploading to a URL is not supported)",
                              param="output_file", value=ns.output_file)
    engine_args = engine_args_from(ns)
    setup = server_setup(ns, engine_args)
    setup.keys = []  # (no client but this command reaches the in-process app)
    with ExitStack() as stack:
        source = stack.enter_context(_open_input(ns.input_file))
        sink = stack.enter_context(open(ns.output_file, "w", encoding="utf-8"))
        metrics = ServerMetrics(setup.names[0], engine_args.data_parallel_size)
        engine = AsyncLLM.from_engine_args(engine_args, on_step=metrics.on_step, multiprocess=engine_core_process())
        try:
            app = app_from_args(ns, engine, metrics, setup)
            window = ns.max_inflight or max(2 * engine.config.scheduler.max_num_seqs, 64)
            counts = asyncio.run(process(app, source, sink, window, ns.max_body_bytes))
        finally:
            engine.close()
    logger.info("run-batch: %d requests, %d failed; output in %s", counts[0], counts[1], ns.output_file)
    return 0


def _open_input(path: str) -> Any:
    """The batch file, opened for reading bytes (an http(s) URL: downloaded to a temporary file first)."""
    if not path.startswith(("http://", "https://")):
        try:
            return open(path, "rb")
        except OSError as e:
            raise ValidationError(f"--input-file: cannot read {quoted(path)}: {e.strerror}", param="input_file",
                                  value=path) from None
    import httpx

    spool = tempfile.TemporaryFile()
    try:
        with httpx.stream("GET", path, follow_redirects=True, timeout=60) as response:
            response.raise_for_status()
            for chunk in response.iter_bytes():
                spool.write(chunk)
    except httpx.HTTPError as e:
        spool.close()
        raise ValidationError(f"--input-file: cannot download {quoted(path)}: {e}", param="input_file",
                              value=path) from None
    spool.seek(0)
    return spool


def read_lines(source: IO[bytes], max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, its bytes) for each non-blank line; None for a line over ``max_bytes`` (skipped unread, so a
    huge line never sits in memory)."""
    number = 0
    while True:
        line = source.readline(max_bytes + 1)
        if not line:
            return
        number += 1
        if len(line) > max_bytes and not line.endswith(b"\n"):
            while (rest := source.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield number, None
            continue
        if line.strip():
            yield number, line.strip()


def count_lines(source: IO[bytes]) -> int:
    """Lines in the file (for the progress bar), then back to its start."""
    count, last = 0, b"\n"
    while chunk := source.read(1 << 20):
        count += chunk.count(b"\n")
        last = chunk[-1:]
    source.seek(0)
    return count + (last != b"\n")


async def process(app: Any, source: IO[bytes], sink: IO[str], window: int, max_bytes: int) -> tuple[int, int]:
    """Every line of ``source`` through ``app`` (at most ``window`` at once), each output line written to
    ``sink`` in input order; returns (requests, failed)."""
    import httpx
    from tqdm import tqdm

    total, failed = 0, 0
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app):  # the engine's loop starts and stops as the server's does
        async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
            pending: collections.deque[asyncio.Task[dict[str, Any]]] = collections.deque()
            with tqdm(total=count_lines(source), desc="Running batch", unit="req") as bar:

                def write(line: dict[str, Any]) -> None:
                    nonlocal failed
                    failed += line["error"] is not None
                    sink.write(json.dumps(line, ensure_ascii=False) + "\n")
                    bar.update(1)

                for number, raw in read_lines(source, max_bytes):
                    total += 1
                    pending.append(asyncio.ensure_future(run_line(client, app, number, raw, max_bytes)))
                    if len(pending) >= window:
                        write(await pending.popleft())
                while pending:
                    write(await pending.popleft())
                bar.total = bar.n  # (blank lines were counted, never run)
                bar.refresh()
    return total, failed


def output_line(custom_id: Any, status: int, body: Any, error: Any) -> dict[str, Any]:
    """One line of OpenAI's batch output format (vLLM's: a failed request's body is null, its error body in
    ``error``)."""
    return {"id": f"pagedllm-{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"pagedllm-batch-{uuid.uuid4().hex}", "body": body},
            "error": error}


def line_error(custom_id: Any, message: str, param: str | None, status: int = 400) -> dict[str, Any]:
    """An output line for a line that could not be sent: an error in OpenAI's shape."""
    error = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    return output_line(custom_id, status, None, error)


async def run_line(client: Any, app: Any, number: int, raw: bytes | None, max_bytes: int) -> dict[str, Any]:
    """One batch line run through the app: its output line (never raises: a failure is that line's error)."""
    from pagedllm.entrypoints.openai.json_scan import check_json_shape

    where = f"line {number}"
    if raw is None:
        return line_error(None, f"{where} is over {max_bytes} bytes (--max-body-bytes)", None, 413)
    try:
        limits = app.state.limits
        await check_json_shape(raw, limits.max_json_values, limits.max_json_depth)
        item = json.loads(raw)
    except ValidationError as e:
        return line_error(None, f"{where}: {e.message}", e.param)
    except (ValueError, RecursionError) as e:
        return line_error(None, f"{where} is not valid JSON: {quoted(str(e))}", None)
    if not isinstance(item, dict):
        return line_error(None, f"{where} must be a JSON object", None)
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str):
        return line_error(None if custom_id is None else quoted(custom_id), f"{where}: custom_id must be a string",
                          "custom_id")
    url, body = item.get("url"), item.get("body")
    if item.get("method", "POST") != "POST":
        return line_error(custom_id, f"{where}: only POST is supported, not {quoted(item.get('method'))}", "method")
    if url not in BATCH_URLS:
        return line_error(custom_id, f"{where}: URL {quoted(url)} is not a supported endpoint; supported: "
                                     f"{', '.join(BATCH_URLS)}", "url")
    if not isinstance(body, dict):
        return line_error(custom_id, f"{where}: body must be a JSON object", "body")
    if body.get("stream"):
        return line_error(custom_id, f"{where}: a batch request must not be streamed (stream: true)", "body.stream")
    if body.get("background"):  # (its answer would be a queued response that nothing polls)
        return line_error(custom_id, f"{where}: a batch request must not run in the background (background: true)",
                          "body.background")
    try:
        response = await client.post(url, content=json.dumps(body, ensure_ascii=False).encode(),
                                     headers={"content-type": "application/json"})
        data = response.json()
    except Exception as e:  # the app answers every request; anything else fails this line only
        logger.exception("run-batch %s failed", where)
        return line_error(custom_id, f"{where} failed: {quoted(str(e))}", None, 500)
    if response.status_code == 200:
        return output_line(custom_id, 200, data, None)
    return output_line(custom_id, response.status_code, None, data)


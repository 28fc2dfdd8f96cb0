"""infinity-emb on the sentences of benchmarks/embed.py: its torch engine on the CPU (batch size 32, its
default), the embeddings awaited for the whole list at once, rounds as there. Run with an interpreter that has
infinity-emb (its own venv; benchmarks/embed.py --infinity does it):

    ~/.cache/pagedllm-peers/infinity/bin/python benchmarks/embed_infinity.py --model FOLDER --sentences S.json

Prints one line per round, then one RESULT JSON line (with the vectors' file, for the cosine against the
reference); an error is printed as it is.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np


async def run(args: argparse.Namespace, sentences: list[str]) -> dict:
    from infinity_emb import AsyncEngineArray, EngineArgs

    array = AsyncEngineArray.from_args([EngineArgs(model_name_or_path=args.model, engine="torch", device="cpu",
                                                   dtype=args.dtype, bettertransformer=False)])
    engine = array[0]
    await engine.astart()
    try:
        await engine.embed(sentences=sentences[:64])  # warm-up
        rates, vectors = [], None
        for r in range(args.rounds):
            start = time.perf_counter()
            vectors, _ = await engine.embed(sentences=sentences)
            rates.append(len(sentences) / (time.perf_counter() - start))
            print(f"round {r + 1}: infinity-emb   {rates[-1]:8.1f} sentences/s", flush=True)
    finally:
        await engine.astop()
    np.save(args.vectors, np.asarray(vectors, dtype=np.float32))
    return {"sentences_per_s": rates, "median": statistics.median(rates), "dtype": args.dtype,
            "vectors": args.vectors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--sentences", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--vectors", default="infinity_vectors.npy")
    args = parser.parse_args()
    sentences = json.load(open(args.sentences))
    print("RESULT " + json.dumps(asyncio.run(run(args, sentences))))


if __name__ == "__main__":
    main()

"""llama.cpp's perplexity on given token ids, windows as `pagedllm bench perplexity` cuts them (run with the
llama-cpp peer's Python: ../shared/peers/llama-cpp python benchmarks/llamacpp_perplexity.py ...):

    ../shared/peers/llama-cpp python benchmarks/llamacpp_perplexity.py --gguf FILE --tokens ids.json --context 512

Each window of --context token ids is evaluated from an empty cache with every position's logits kept;
each token but the window's first is scored by the log-softmax of the logits before it. Prints one
RESULT {json} line.
"""
import argparse
import json
import math

import llama_cpp
import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--gguf", required=True)
ap.add_argument("--tokens", required=True, help="a JSON list of token ids")
ap.add_argument("--context", type=int, default=512)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
ids = json.load(open(args.tokens))
llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=args.context, n_batch=args.context, logits_all=True,
                      n_threads=args.threads, verbose=False)
nll = []
for start in range(0, len(ids), args.context):
    window = ids[start:start + args.context]
    if len(window) < 2:
        continue
    llm.reset()
    llm.eval(window)
    logits = np.asarray(llm.scores[:len(window)], dtype=np.float64)  # (len, vocab)
    shifted = logits - logits.max(-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll += [-logprobs[i, window[i + 1]] for i in range(len(window) - 1)]
print("RESULT " + json.dumps({"perplexity": math.exp(sum(nll) / len(nll)), "scored_tokens": len(nll)}))

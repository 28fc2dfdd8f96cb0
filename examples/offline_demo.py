"""Offline generation with the default model (SmolLM2-135M-Instruct): what `make demo` runs."""
from pagedllm import LLM, SamplingParams

prompts = [
    "The three primary colors are",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain in one sentence what a paged KV cache is.",
]


def main() -> None:
    llm = LLM()
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, seed=0)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        print(f"\n>>> {prompt}\n{out.outputs[0].text.strip()}")
    stats = llm.get_stats()
    print(f"\n[{stats.num_steps} steps, max {stats.max_num_running} requests at once, "
          f"peak KV usage {stats.max_kv_cache_usage:.1%} of {stats.num_kv_blocks} blocks]")


if __name__ == "__main__":
    main()

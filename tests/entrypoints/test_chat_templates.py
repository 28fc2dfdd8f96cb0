"""Models without a chat template: chat() and /v1/chat/completions refuse by naming chat_template, and a
template given (chat_template=, --chat-template FILE) is used, with bos_token in its context."""
from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from pagedllm import LLM, SamplingParams, ValidationError
from tests.utils import RemoteServer

TEMPLATE = "{% for m in messages %}{{ bos_token }}{{ m['content'] }} {% endfor %}"


def test_chat_without_a_template_names_chat_template(tiny_model) -> None:
    llm = LLM(str(tiny_model("llama-gqa-untied")), dtype="float32", num_kv_blocks=32)
    messages = [{"role": "user", "content": "t5 t6 t7"}]
    with pytest.raises(ValidationError) as err:
        llm.chat(messages, use_tqdm=False)
    assert err.value.param == "chat_template" and "chat_template=" in str(err.value)
    out = llm.chat(messages, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False, chat_template=TEMPLATE)
    assert out[0].prompt == "t1t5 t6 t7 " and out[0].prompt_token_ids == [1, 5, 6, 7]  # bos_token: "t1"
    llm.shutdown()


def test_server_chat_template_file(tiny_model, tmp_path: Path) -> None:
    path = tiny_model("llama-gqa-untied")
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    with_file = RemoteServer(path, "--served-model-name", "tiny", "--chat-template", str(template))
    without = RemoteServer(path, "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=f"{with_file.url}/v1", api_key="x")
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t5 t6"}],
                                               max_tokens=2, extra_body={"ignore_eos": True})
        assert reply.usage.prompt_tokens == 3 and reply.choices[0].finish_reason == "length"
        refused = httpx.post(f"{without.url}/v1/chat/completions", timeout=30,
                             json={"model": "tiny", "messages": [{"role": "user", "content": "t5"}]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    finally:
        with_file.stop()
        without.stop()

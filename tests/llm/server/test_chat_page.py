"""The chat page of `metalnn serve` in a real headless Chromium (Selenium).

The page is served by a child server process on the tiny random model; what the page shows is
compared with `metalnn.llm.text_generation.TextStream` run here on the same checkpoint (greedy decoding:
the same text exactly). Screenshots stay in the test's tmp_path.
"""

import time

import pytest

import metalnn as mn
from metalnn.llm.sampling import DEFAULT_TEMPERATURE
from metalnn.llm.text_generation import TextStream

from app_models import save_tiny_model
from browser import chromium, needs_browser, screenshot
from server_process import running_server

pytestmark = needs_browser

# records every text the assistant's bubbles show, to see the answer grow piece by piece
RECORD_UPDATES = """
window.shown = [];
new MutationObserver(() => {
  const all = document.querySelectorAll('.message.assistant .content');
  if (all.length) window.shown.push(all[all.length - 1].textContent);
}).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
"""


def text_of(driver, css):
    return [e.get_attribute("textContent") for e in driver.find_elements("css selector", css)]


def wait_for(driver, condition, timeout=60, what="the page"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d),
                                                                      message=f"waiting for {what}")


def answered(n):
    """The n-th assistant answer is complete (its speed line is shown)."""
    def check(driver):
        metas = text_of(driver, ".message.assistant .meta")
        return len(metas) >= n and "tokens/s" in metas[n - 1] and metas[n - 1]
    return check


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # wide enough (512, 8 layers: ~80 tokens/s on two cores) that the 3000-token answer of the Stop
    # check is still running when the page has shown five pieces of it; the 64-wide app model
    # decodes 3000 tokens in about two seconds, which a loaded machine's browser may not outlast
    # (seed 1: its first answer runs to the 40-token limit, its third past 600 tokens)
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", hidden_size=512, num_hidden_layers=8, seed=1)


def greedy(model, tok, messages, max_tokens):
    return "".join(TextStream(model, tok, tok.apply_chat_template(messages), max_tokens, temperature=0.0))


def test_chat_page_streams_answers_keeps_history_and_stops(tiny, tmp_path):
    from selenium.webdriver.common.keys import Keys

    model, tok = mn.models.load_pretrained(tiny), mn.models.load_tokenizer(tiny)
    with running_server(tiny, tmp_path / "logs") as server, chromium(tmp_path / "profile") as driver:
        driver.get(server.url + "/")
        wait_for(driver, lambda d: d.find_element("id", "model-name").text == "tiny", what="the model name")
        assert driver.title == "tiny · metalnn chat"
        # the slider shows the server's default sampling (the model has no generation_config.json)
        assert driver.find_element("id", "temperature-value").text == f"{DEFAULT_TEMPERATURE:.2f}"
        # controls: temperature 0 (Home key on the slider), at most 40 tokens
        driver.find_element("id", "temperature").send_keys(Keys.HOME)
        assert driver.find_element("id", "temperature-value").text == "0.00"
        box = driver.find_element("id", "max-tokens")
        box.clear()
        box.send_keys("40")
        driver.execute_script(RECORD_UPDATES)

        message = driver.find_element("id", "message")
        message.send_keys("Hello page", Keys.ENTER)  # Enter sends
        meta = wait_for(driver, answered(1), what="the first answer")
        first = greedy(model, tok, [{"role": "user", "content": "Hello page"}], 40)
        assert text_of(driver, ".message.user .content") == ["Hello page"]
        assert text_of(driver, ".message.assistant .content") == [first]
        assert meta.startswith("40 tokens · ") and "max tokens reached" in meta, meta
        assert message.get_attribute("value") == ""

        # a second turn: the page sends the whole conversation
        message.send_keys("And again", Keys.ENTER)
        wait_for(driver, answered(2), what="the second answer")
        second = greedy(model, tok, [{"role": "user", "content": "Hello page"}, {"role": "assistant", "content": first},
                                     {"role": "user", "content": "And again"}], 40)
        assert text_of(driver, ".message.assistant .content")[1] == second
        assert "tokens/s" in driver.find_element("id", "status").text
        screenshot(driver, tmp_path / "chat.png")

        # Stop: a long answer is cut short, in the page and on the server
        box.clear()
        box.send_keys("3000")
        cancelled = server.health()["cancelled"]
        start = driver.execute_script("return window.shown.length")
        message.send_keys("Now talk for a long time", Keys.ENTER)
        # the answer appears piece by piece: wait until it has been shown at five different lengths
        seen = lambda d: {t for t in d.execute_script(f"return window.shown.slice({start})") if t}  # noqa: E731
        wait_for(driver, lambda d: len(seen(d)) >= 5, what="the third answer to grow")
        assert driver.find_element("id", "send").get_attribute("disabled") is not None
        driver.find_element("id", "stop").click()
        meta = wait_for(driver, answered(3), what="the stopped answer")
        assert meta.endswith("· stopped"), meta
        third = text_of(driver, ".message.assistant .content")[2]
        assert all(third.startswith(t) for t in seen(driver))  # each step showed a beginning of the answer
        assert int(meta.split()[0]) < 3000
        assert server.wait_idle(timeout=20)["cancelled"] == cancelled + 1
        assert driver.find_element("id", "stop").get_attribute("disabled") is not None
        assert driver.find_element("id", "send").get_attribute("disabled") is None
        screenshot(driver, tmp_path / "chat-stopped.png")

        # New chat clears the conversation
        driver.find_element("id", "new-chat").click()
        assert text_of(driver, ".message") == []
        time.sleep(0.1)
        assert driver.find_element("id", "empty").is_displayed()


def test_untouched_temperature_leaves_sampling_to_the_model(tiny, tmp_path):
    """A model whose generation_config.json asks for greedy decoding: the page shows 0 and, without
    the slider being moved, sends no temperature, so its answer is the greedy one."""
    import shutil

    from selenium.webdriver.common.keys import Keys

    folder = shutil.copytree(tiny, tmp_path / "greedy")
    (folder / "generation_config.json").write_text('{"do_sample": false}')
    model, tok = mn.models.load_pretrained(folder), mn.models.load_tokenizer(folder)
    with running_server(folder, tmp_path / "logs") as server, chromium(tmp_path / "profile") as driver:
        driver.get(server.url + "/")
        wait_for(driver, lambda d: d.find_element("id", "model-name").text == "greedy", what="the model name")
        assert driver.find_element("id", "temperature-value").text == "0.00"
        box = driver.find_element("id", "max-tokens")
        box.clear()
        box.send_keys("30")
        driver.find_element("id", "message").send_keys("Hello page", Keys.ENTER)
        wait_for(driver, answered(1), what="the answer")
        want = greedy(model, tok, [{"role": "user", "content": "Hello page"}], 30)
        assert text_of(driver, ".message.assistant .content") == [want]

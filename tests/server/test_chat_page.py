"""The chat page at / in a real browser: Debian's headless Chromium, driven through its WebDriver
(selenium), against a live server (SmolLM2 Q8_0 on the CPU, --exact, in process, with an API key). The page
asks for the key, streams a greedy reply equal to the API's for the same conversation, keeps the
conversation for a second turn, and stops a reply when asked. A screenshot goes to the test's
temporary directory, or to NVMEDIRECT_SCREENSHOT when set (docs/chat-page.png was made so)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infer.server.app import Server
from infer.server.run import loader
from infer.tiers.config import StreamingConfig
from tests.oracle.assets import smollm2_path
from tests.server.test_server_edges import InProcess

pytestmark = [pytest.mark.browser, pytest.mark.slow]
CTX = 1024
KEY = "sk-page"


@pytest.fixture(scope="module")
def served() -> Iterator[InProcess]:
    path = smollm2_path("Q8_0")
    if not path.exists():
        pytest.skip(f"{path} missing: run scripts/fetch-models.sh")
    s = InProcess(Server(loader(str(path), "cpu", CTX, 2, StreamingConfig(), exact=True), CTX, 2, 4, api_key=KEY))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1000,700"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    yield driver
    driver.quit()


def _wait(condition, seconds: float = 120.0) -> object:  # noqa: ANN001 - a callable returning a truthy value
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("the page did not get there in time")


def _replies(driver: object) -> list[object]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")  # type: ignore[attr-defined]


def _ask(driver: object, text: str) -> object:
    """Types `text`, presses Enter and waits until its reply has finished streaming."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    before = len(_replies(driver))
    box = driver.find_element(By.ID, "input")  # type: ignore[attr-defined]
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    reply = _wait(lambda: len(_replies(driver)) > before and _replies(driver)[-1])
    _wait(lambda: reply.get_attribute("data-state") == "done")  # type: ignore[attr-defined]
    return reply


def _answer_text(reply: object) -> str:
    """The reply's text without its stats line."""
    from selenium.webdriver.common.by import By

    stats = reply.find_element(By.CLASS_NAME, "stats").text  # type: ignore[attr-defined]
    return reply.text.removesuffix(stats).rstrip("\n")  # type: ignore[attr-defined]


def test_the_chat_page_streams_replies_in_a_browser(served: InProcess, browser: object, tmp_path: Path) -> None:
    import openai
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(f"http://127.0.0.1:{served.port}/")  # type: ignore[attr-defined]
    key_box = driver.find_element(By.ID, "keybox")  # type: ignore[attr-defined]
    _wait(lambda: key_box.is_displayed())  # the server has a key: the page asks for it
    driver.find_element(By.ID, "key").send_keys(KEY)  # type: ignore[attr-defined]
    driver.find_element(By.ID, "save-key").click()  # type: ignore[attr-defined]
    _wait(lambda: "SmolLM2-135M" in driver.find_element(By.ID, "model").text)  # type: ignore[attr-defined]
    assert not key_box.is_displayed()
    for field, value in (("temperature", "0"), ("max-tokens", "24")):
        box = driver.find_element(By.ID, field)  # type: ignore[attr-defined]
        box.clear()
        box.send_keys(value)

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key=KEY, max_retries=0)
    history = [{"role": "user", "content": "What is the capital of France?"}]
    reply = _ask(driver, history[0]["content"])
    want = client.chat.completions.create(model="m", messages=history, max_tokens=24, temperature=0)
    assert _answer_text(reply) == want.choices[0].message.content
    assert reply.get_attribute("data-finish") == want.choices[0].finish_reason  # type: ignore[attr-defined]
    assert "tokens" in reply.find_element(By.CLASS_NAME, "stats").text  # type: ignore[attr-defined]

    # the second turn carries the first: the page resends the conversation
    history += [{"role": "assistant", "content": want.choices[0].message.content},
                {"role": "user", "content": "And of Italy?"}]
    second = _ask(driver, "And of Italy?")
    want2 = client.chat.completions.create(model="m", messages=history, max_tokens=24, temperature=0)
    assert _answer_text(second) == want2.choices[0].message.content
    shot = Path(os.environ.get("NVMEDIRECT_SCREENSHOT") or tmp_path / "chat-page.png")
    assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000  # type: ignore[attr-defined]

    # Stop while a long reply streams
    driver.find_element(By.ID, "max-tokens").clear()  # type: ignore[attr-defined]
    driver.find_element(By.ID, "max-tokens").send_keys("300")  # type: ignore[attr-defined]
    box = driver.find_element(By.ID, "input")  # type: ignore[attr-defined]
    box.send_keys("Write a long story about a dragon.")
    driver.find_element(By.ID, "send").click()  # type: ignore[attr-defined]
    streaming = _wait(lambda: len(_replies(driver)) == 3 and _replies(driver)[-1])
    _wait(lambda: len(streaming.text) > 10)  # type: ignore[attr-defined]
    driver.find_element(By.ID, "send").click()  # type: ignore[attr-defined]  # now labelled Stop
    _wait(lambda: streaming.get_attribute("data-state") == "done", 30)  # type: ignore[attr-defined]
    assert streaming.get_attribute("data-finish") == "stopped"  # type: ignore[attr-defined]
    _wait(lambda: served.metrics().get("ntransformer_active_requests") == 0, 30)


def test_the_chat_page_shows_a_reasoning_models_thinking_apart(browser: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply with reasoning_content deltas (gpt-oss's harmony form, the text of SmolLM2's tokens
    scripted as in tests/server/test_reasoning_replies.py): the page shows the thinking in its own
    dimmed block above the answer and keeps only the answer as the reply."""
    from selenium.webdriver.common.by import By

    import infer.scheduler
    from tests.server.test_reasoning_replies import HARMONY_PIECES, ScriptedDecoder, _served

    monkeypatch.setattr(infer.scheduler, "StreamDecoder", ScriptedDecoder)
    ScriptedDecoder.script = HARMONY_PIECES
    served = _served("harmony")
    try:
        driver = browser
        driver.get(f"http://127.0.0.1:{served.port}/")  # type: ignore[attr-defined]
        _wait(lambda: "SmolLM2" in driver.find_element(By.ID, "model").text)  # type: ignore[attr-defined]
        for field, value in (("temperature", "0"), ("max-tokens", str(len(HARMONY_PIECES)))):
            box = driver.find_element(By.ID, field)  # type: ignore[attr-defined]
            box.clear()
            box.send_keys(value)
        reply = _ask(driver, "What is 2+2?")
        assert reply.find_element(By.CLASS_NAME, "thinking").text == "Two plus two."  # type: ignore[attr-defined]
        assert _answer_text(reply) == "Two plus two.\nIt is 4."  # the block, then the answer
        sent = driver.execute_script("return messages[messages.length - 1]")  # type: ignore[attr-defined]
        assert sent == {"role": "assistant", "content": "It is 4."}
    finally:
        served.stop()

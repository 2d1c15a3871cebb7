"""The chat page at / in a real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium) against the real server with SmolLM2: a message typed in the textarea gets a streamed
answer in a [data-role="assistant"] element, the stop button ends a long answer (and the
server's slot), a reload keeps the conversation (localStorage), model output is escaped
(an <img onerror> in a streamed answer shows as text), reasoning deltas are shown collapsed, and
the browser's console has no errors throughout."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait
from test_server import Server

pytestmark = pytest.mark.slow
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
INJECTION = '<img src=x onerror="window.__pwned = 1"><script>window.__pwned = 2</script>'
ANSWERS = '[data-role="assistant"]'
MTMD = Path(__file__).parent / "data" / "mtmd"


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    s = Server(smollm2_path, tmp_path_factory.mktemp("webui") / "server.log", "-np", "2", "-c", "2048",
               "--no-warmup")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no chromium or chromedriver on PATH: apt-get install chromium chromium-driver (.ci/run does)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page(browser, server):
    browser.get(server.url + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model-name").text != "ggmlx")
    yield browser
    assert_no_console_errors(browser)


def assert_no_console_errors(driver) -> None:
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def set_field(driver, element_id: str, value: str) -> None:
    """Type into a settings field as a person would (select all, delete, type)."""
    el = driver.find_element(By.ID, element_id)
    el.send_keys(Keys.CONTROL + "a", Keys.BACKSPACE)
    if value:
        el.send_keys(value)


def settings(driver, **fields: str) -> None:
    if not driver.find_element(By.ID, "settings").is_displayed():
        driver.find_element(By.ID, "settings-toggle").click()
    for element_id, value in fields.items():
        set_field(driver, element_id.replace("_", "-"), value)


def answering(driver) -> bool:
    return driver.find_element(By.ID, "stop").is_displayed()


def last_answer(driver):
    return driver.find_elements(By.CSS_SELECTOR, ANSWERS)[-1]


def wait_answered(driver, timeout: float = 300):
    WebDriverWait(driver, timeout).until(lambda d: d.find_elements(By.CSS_SELECTOR, ANSWERS) and not answering(d))
    return last_answer(driver)


def test_a_typed_message_gets_a_streamed_answer(page):
    settings(page, temperature="0", max_tokens="24")
    box = page.find_element(By.CSS_SELECTOR, "#composer textarea")
    box.send_keys("What is the capital of France?", Keys.ENTER)
    WebDriverWait(page, 300).until(lambda d: d.find_elements(By.CSS_SELECTOR, ANSWERS))
    answer = wait_answered(page)
    text = answer.find_element(By.CLASS_NAME, "content").text
    assert text.strip() and "Paris" in text, text
    assert "tokens/s" in answer.find_element(By.CLASS_NAME, "stats").text
    assert page.find_element(By.CSS_SELECTOR, '[data-role="user"]').text == "What is the capital of France?"
    assert box.get_attribute("value") == ""
    assert_no_console_errors(page)


def test_a_reload_keeps_the_conversation_and_the_settings(page):
    before = [(m.get_attribute("data-role"), m.text) for m in page.find_elements(By.CLASS_NAME, "message")]
    assert len(before) == 2
    page.refresh()
    WebDriverWait(page, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ANSWERS))
    after = [(m.get_attribute("data-role"), m.text) for m in page.find_elements(By.CLASS_NAME, "message")]
    assert after == before
    assert page.find_element(By.ID, "temperature").get_attribute("value") == "0"
    assert page.find_element(By.ID, "max-tokens").get_attribute("value") == "24"
    assert len(page.find_elements(By.CSS_SELECTOR, "#conversations li")) == 1
    assert_no_console_errors(page)


def test_the_stop_button_ends_a_long_answer(page, server):
    page.find_element(By.ID, "new-chat").click()
    assert not page.find_elements(By.CLASS_NAME, "message")
    settings(page, max_tokens="900")
    page.find_element(By.ID, "input").send_keys("Write a long story about a dragon who learns to bake bread.")
    page.find_element(By.ID, "send").click()
    WebDriverWait(page, 300).until(lambda d: len(last_answer(d).text) > 40)
    assert answering(page)
    page.find_element(By.ID, "stop").click()
    WebDriverWait(page, 10).until(lambda d: not answering(d))
    answer = last_answer(page)
    stopped = answer.find_element(By.CLASS_NAME, "content").text
    time.sleep(1.5)
    assert answer.find_element(By.CLASS_NAME, "content").text == stopped      # nothing more arrived
    assert "(stopped)" in answer.find_element(By.CLASS_NAME, "stats").text
    deadline = time.time() + 10       # the server saw the disconnect and freed the slot
    while httpx.get(server.url + "/health").json()["slots_processing"] and time.time() < deadline:
        time.sleep(0.2)
    assert httpx.get(server.url + "/health").json()["slots_processing"] == 0
    assert len(page.find_elements(By.CSS_SELECTOR, "#conversations li")) == 2
    assert_no_console_errors(page)


def test_markdown_renders_and_escapes(page):
    render = "return renderMarkdown(arguments[0]);"
    assert page.execute_script(render, INJECTION) == (
        "<p>&lt;img src=x onerror=&quot;window.__pwned = 1&quot;&gt;&lt;script&gt;window.__pwned = 2"
        "&lt;/script&gt;</p>")
    assert page.execute_script(render, "**a** and *b* and `<b>`") == \
        "<p><strong>a</strong> and <em>b</em> and <code>&lt;b&gt;</code></p>"
    assert page.execute_script(render, "- one\n- two\n\n1. x\n2. y") == \
        "<ul><li>one</li><li>two</li></ul><ol><li>x</li><li>y</li></ol>"
    assert page.execute_script(render, "```py\nif a < b:\n    pass\n```\nafter") == \
        '<pre><code class="language-py">if a &lt; b:\n    pass</code></pre><p>after</p>'
    assert page.execute_script(render, '```"><img src=x>\nx\n```') == "<pre><code>x</code></pre>"
    assert page.execute_script(render, "snake_case_name") == "<p>snake_case_name</p>"


FAKE_STREAM = """
const chunks = arguments[0];
window.fetch = async () => new Response(new ReadableStream({
  start(c) {
    for (const d of chunks) c.enqueue(new TextEncoder().encode('data: ' + JSON.stringify(d) + '\\n\\n'));
    c.enqueue(new TextEncoder().encode('data: [DONE]\\n\\n'));
    c.close();
  }
}), {status: 200, headers: {'Content-Type': 'text/event-stream'}});
"""


def test_a_streamed_answer_with_html_shows_as_text_and_reasoning_collapsed(page):
    """The page's own stream reader and renderer on a stream with chosen deltas (fetch replaced in
    the page): HTML in the content stays text, reasoning_content goes to a closed <details>."""
    deltas = [{"reasoning_content": "Let me think "}, {"reasoning_content": "<b>hard</b>."},
              {"content": INJECTION[:9]}, {"content": INJECTION[9:] + "\n\n**bold**\n```\n<script>x()</script>\n```"}]
    page.execute_script(FAKE_STREAM, [{"choices": [{"index": 0, "delta": d}]} for d in deltas])
    page.find_element(By.ID, "input").send_keys("show me html", Keys.ENTER)
    answer = wait_answered(page, 30)
    assert not answer.find_elements(By.TAG_NAME, "img") and not answer.find_elements(By.TAG_NAME, "script")
    assert not answer.find_elements(By.TAG_NAME, "b")
    content = answer.find_element(By.CLASS_NAME, "content")
    assert INJECTION in content.text
    assert content.find_element(By.TAG_NAME, "strong").text == "bold"
    assert content.find_element(By.CSS_SELECTOR, "pre code").text == "<script>x()</script>"
    details = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert details.get_attribute("open") is None
    assert page.execute_script("return arguments[0].querySelector('.thoughts').textContent", details) == \
        "Let me think <b>hard</b>."
    assert page.execute_script("return window.__pwned") is None
    page.refresh()          # the page's own fetch again
    WebDriverWait(page, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ANSWERS))
    assert not last_answer(page).find_elements(By.TAG_NAME, "img")
    assert page.execute_script("return window.__pwned") is None
    assert_no_console_errors(page)


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    """The tiny seeded gemma3 pair of tests/data/mtmd (text model and mmproj)."""
    s = Server(MTMD / "gemma3.gguf", tmp_path_factory.mktemp("webui-vision") / "server.log",
               "--mmproj", str(MTMD / "gemma3.mmproj.gguf"), "-np", "1", "-c", "1024", "--no-warmup")
    yield s
    s.stop()


def test_an_attached_image_goes_with_the_message(browser, vision_server):
    """With --mmproj the page offers an image input (hidden without: /props' modalities); the
    picked file is shown in the user's message and sent as an image_url part, so the answer is
    LLM.chat's for the same image and text at temperature 0."""
    browser.get(vision_server.url + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "attach-label").is_displayed())
    settings(browser, temperature="0", max_tokens="8")
    image = MTMD / "test-image.png"
    browser.find_element(By.ID, "attach").send_keys(str(image))
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "attachment").text == image.name)
    browser.find_element(By.CSS_SELECTOR, "#composer textarea").send_keys("What is in this picture?", Keys.ENTER)
    wait_answered(browser)
    assert browser.find_elements(By.CSS_SELECTOR, '[data-role="user"] img.attached')
    assert browser.find_element(By.ID, "attachment").text == ""
    saved = browser.execute_script("return JSON.parse(localStorage.getItem('ggmlx.chat'))")
    user, answer = next(c for c in saved["conversations"] if c["id"] == saved["current"])["messages"]
    assert user["image"].startswith("data:image/png;base64,")
    import llm
    m = llm.LLM(str(MTMD / "gemma3.gguf"), n_ctx=1024, mmproj=str(MTMD / "gemma3.mmproj.gguf"))
    want = m.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": user["image"]}},
                                                {"type": "text", "text": "What is in this picture?"}]}],
                  max_tokens=8, temperature=0.0)
    assert want.text and answer["content"] == want.text
    assert_no_console_errors(browser)

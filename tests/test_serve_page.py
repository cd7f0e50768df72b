"""`nmt serve`'s page (GET /) in a real browser: headless Chromium, driven over the DevTools protocol, types into the
page served by a live `nmt serve` on loopback, and what the page shows is what POST /translate answers.

Chromium is Debian's `chromium` package; the fixture installs it with apt-get where it is missing and skips (saying
why) only where it cannot. The protocol runs over a pipe (`--remote-debugging-pipe`: commands on fd 3, answers on
fd 4, each a JSON message ended by NUL), so no websocket client is needed.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from helpers import serving  # noqa: E402

KEY = "s3cret-page-key"


@pytest.fixture(scope="session")
def chromium() -> str:
    """The chromium executable, installed with apt-get (as root, or with sudo -n) where it is missing."""
    found = shutil.which("chromium")
    if found is None and shutil.which("apt-get"):
        prefix = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
        if prefix is not None:
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            install = subprocess.run([*prefix, "apt-get", "install", "-y", "--no-install-recommends", "chromium"],
                                     capture_output=True, text=True, env=env, timeout=900)
            if install.returncode != 0:  # a stale package list: read it anew once
                subprocess.run([*prefix, "apt-get", "update"], capture_output=True, env=env, timeout=900)
                subprocess.run([*prefix, "apt-get", "install", "-y", "--no-install-recommends", "chromium"],
                               capture_output=True, env=env, timeout=900)
            found = shutil.which("chromium")
    if found is None:
        pytest.skip("headless Chromium is not installed and apt-get cannot install it here (needs root or "
                    "passwordless sudo, and Debian's package list): apt-get install chromium")
    return found


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol on a pipe."""

    def __init__(self, executable: str, profile: Path):
        to_chrome, self._send_fd = os.pipe()
        self._read_fd, from_chrome = os.pipe()
        argv = [executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--remote-debugging-pipe", f"--user-data-dir={profile}",
                "--window-size=1200,800", "about:blank"]
        # the protocol's descriptors are 3 (commands) and 4 (answers) in chromium
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{to_chrome} 4>&{from_chrome}', "chromium", *argv],
                                     pass_fds=(to_chrome, from_chrome), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        os.close(to_chrome)
        os.close(from_chrome)
        self._buffer, self._last_id, self.session = b"", 0, None

    def send(self, method: str, params: dict | None = None, timeout: float = 60) -> dict:
        self._last_id += 1
        message = {"id": self._last_id, "method": method, "params": params or {}}
        if self.session is not None and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self.session
        os.write(self._send_fd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._read_fd], [], [], left)[0]:
                    raise TimeoutError(f"chromium did not answer {method} within {timeout} s")
                chunk = os.read(self._read_fd, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium closed the protocol pipe: {self.proc.stderr.read()[-2000:]!r}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._last_id:  # events and other answers are not waited for
                assert "error" not in reply, (method, reply["error"])
                return reply["result"]

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Page.navigate", {"url": url})

    def js(self, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(f"(() => {{ try {{ return {expression}; }} catch (e) {{ return null; }} }})()")  # loading
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"not true within {timeout} s: {expression}; the page shows "
                             f"{self.js('document.body.innerText')!r}")

    def type(self, text: str) -> None:
        """Key by key into the focused element, as a person types (the Enter key for a line end, Tab for a TAB)."""
        for ch in text:
            if ch == "\n":
                key = {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13, "text": "\r"}
            elif ch == "\t":
                key = {"key": "Tab", "code": "Tab", "windowsVirtualKeyCode": 9}
            else:
                key = {"key": ch, "text": ch}
            self.send("Input.dispatchKeyEvent", {"type": "keyDown", **key})
            self.send("Input.dispatchKeyEvent", {"type": "keyUp", **{k: v for k, v in key.items() if k != "text"}})

    def paste(self, text: str) -> None:
        self.send("Input.insertText", {"text": text})

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001 - it is going away either way
            self.proc.kill()
            self.proc.wait(timeout=30)
        os.close(self._send_fd)
        os.close(self._read_fd)


@pytest.fixture(scope="module")
def model_dir(corpus_dir, tmp_path_factory) -> Path:
    """A tiny two-pair multilingual model (en->xx, xx->en): the page offers its target languages."""
    from nmt import train
    from nmt.compat import reset_accelerate_state
    from tests.conftest import multilingual_config

    reset_accelerate_state()
    result = train(multilingual_config(corpus_dir, tmp_path_factory.mktemp("page"), max_steps=12, eval_every=6))
    reset_accelerate_state()
    return result.model_dir


def shown(browser: Browser) -> list[list[str]]:
    """The page's translation list: [text, confidence] per sentence."""
    return browser.js("[...document.querySelectorAll('#output li')].map(li => "
                      "[li.querySelector('.text').textContent, (li.querySelector('.conf') || {}).textContent])")


def settled(browser: Browser, request: dict, timeout: float = 120) -> str:
    """Waits until the page shows the answer (translations or an error) to exactly `request`, the body it sends
    POST /translate; its state then, "done" or "error"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, sent = browser.wait_for("[document.body.dataset.state, document.body.dataset.request || '']")
        if state in ("done", "error") and sent and json.loads(sent) == {**request, "scores": True}:
            return state
        time.sleep(0.05)
    raise AssertionError(f"no answer to {request} within {timeout} s; the page sent {sent!r} and shows "
                         f"{browser.js('document.body.innerText')!r}")


@pytest.mark.slow
def test_the_page_translates_as_you_type_what_translate_answers(chromium, model_dir, corpus_dir, tmp_path):
    """Against `nmt serve --api-key` on loopback: the page asks for the key (the server's 401 shown as worded) and
    keeps it out of storage; typed sentences are translated once typing pauses (debounced: a few requests for many
    keys), each shown with its confidence, as POST /translate answers for the same text and target language; the
    language select holds the model's target languages; a sentence over --max-chars and a glossary show what the
    server answers, error or translation, in its words. A screenshot goes to the test's folder."""
    lines = (corpus_dir / "test.en").read_text(encoding="utf-8").splitlines()[:2]
    with serving(model_dir, "--max-chars", "120", env={"NMT_API_KEY": KEY}) as server:
        auth = {"Authorization": f"Bearer {KEY}"}

        def translate(body: dict) -> tuple[int, dict]:
            return server.call("POST", "/translate", {**body, "scores": True}, headers=auth)

        browser = Browser(chromium, tmp_path / "profile")
        try:
            browser.open(f"http://127.0.0.1:{server.port}/")
            browser.wait_for("document.body.dataset.state === 'error'")  # GET /info without the key: 401
            assert browser.js("document.getElementById('keybox').hidden") is False
            assert browser.js("document.getElementById('error').textContent") == server.call("GET", "/info")[1]["error"]
            browser.js("document.getElementById('key').focus()")
            browser.type(KEY + "\n")  # Enter submits the key form
            browser.wait_for("['ready', 'done'].includes(document.body.dataset.state)")
            assert browser.js("[document.getElementById('key').value, localStorage.length, sessionStorage.length, "
                              "document.cookie, location.href.includes('s3cret')]") == ["", 0, 0, "", False]
            languages = server.call("GET", "/info", headers=auth)[1]["target_languages"]
            assert len(languages) == 2 and browser.js(
                "[...document.getElementById('tgt').options].map(o => o.value)") == languages

            before = server.call("GET", "/stats", headers=auth)[1]["requests"]
            browser.js("document.getElementById('source').focus()")
            browser.type("\n".join(lines))
            assert settled(browser, {"sentences": lines, "tgt_lang": languages[0]}) == "done"
            typed = server.call("GET", "/stats", headers=auth)[1]["requests"] - before
            assert 1 <= typed <= len("\n".join(lines)) // 4, typed  # debounced, not a request per key
            status, answer = translate({"sentences": lines, "tgt_lang": languages[0]})
            assert status == 200 and shown(browser) == [[t["text"], f"{t['confidence']:.2f}"]
                                                        for t in answer["translations"]]

            browser.js(f"{{ const s = document.getElementById('tgt'); s.value = {json.dumps(languages[1])}; "
                       "s.dispatchEvent(new Event('change')); }")
            assert settled(browser, {"sentences": lines, "tgt_lang": languages[1]}) == "done"
            answer = translate({"sentences": lines, "tgt_lang": languages[1]})[1]
            assert shown(browser) == [[t["text"], f"{t['confidence']:.2f}"] for t in answer["translations"]]

            long_line = "word " * 30  # 150 characters: over --max-chars 120
            browser.paste("\n" + long_line)
            assert settled(browser, {"sentences": [*lines, long_line], "tgt_lang": languages[1]}) == "error"
            status, answer = translate({"sentences": [*lines, long_line], "tgt_lang": languages[1]})
            assert status == 413 and browser.js("document.getElementById('error').textContent") == answer["error"]
            browser.js("{ const s = document.getElementById('source'); s.value = s.value.split('\\n').slice(0, 2)"
                       ".join('\\n'); s.dispatchEvent(new Event('input')); }")
            assert settled(browser, {"sentences": lines, "tgt_lang": languages[1]}) == "done"

            term = lines[0].split()[0]
            browser.js("document.getElementById('glossary').focus()")
            browser.type(f"{term}\tzyx")
            state = settled(browser, {"sentences": lines, "tgt_lang": languages[1], "glossary": [[term, "zyx"]]})
            status, answer = translate({"sentences": lines, "tgt_lang": languages[1], "glossary": [[term, "zyx"]]})
            if status == 200:  # a server that takes glossaries: the constrained translations
                assert state == "done" and shown(browser) == [[t["text"], f"{t['confidence']:.2f}"]
                                                              for t in answer["translations"]]
            else:  # one that refuses this glossary: its words
                assert state == "error" and browser.js("document.getElementById('error').textContent") == answer["error"]

            png = base64.b64decode(browser.send("Page.captureScreenshot", {"format": "png"})["data"])
            (tmp_path / "page.png").write_bytes(png)
            assert png.startswith(b"\x89PNG") and len(png) > 10_000
        finally:
            browser.close()


@pytest.mark.slow
def test_the_page_marks_what_the_guard_left_doubtful(chromium, tmp_path):
    """Against `nmt serve --guard` on a random model that loops: the page shows each translation's doubt as
    POST /translate answers it (issue 45, part 3), and none beside the translations that passed."""
    from helpers import model_dir as random_model

    from nmt.synthetic import generate_pairs

    sources = [a for a, _ in generate_pairs(96, seed=5)][88:]  # this random model loops on one past the fallback
    with serving(random_model(tmp_path / "model", seed=2), "--guard") as server:
        status, answer = server.call("POST", "/translate", {"sentences": sources, "scores": True})
        doubts = [t["doubt"] for t in answer["translations"]]
        assert status == 200 and "loop" in doubts and "" in doubts  # some left doubtful, some passed
        browser = Browser(chromium, tmp_path / "profile")
        try:
            browser.open(f"http://127.0.0.1:{server.port}/")
            browser.wait_for("['ready', 'done'].includes(document.body.dataset.state)")
            browser.js("document.getElementById('source').focus()")
            browser.paste("\n".join(sources))
            assert settled(browser, {"sentences": sources}) == "done"
            assert browser.js("[...document.querySelectorAll('#output li')].map(li => "
                              "(li.querySelector('.doubt') || {}).textContent || '')") == doubts
            assert [text for text, _ in shown(browser)] == [t["text"] for t in answer["translations"]]
        finally:
            browser.close()

"""Open an HTML report in a real headless browser (Chromium, through Qt WebEngine) and print
what the page shows as JSON: title, verdict text, and each image's decoded size.

    python tests/browser_check.py REPORT.html      # needs: pip install PyQt6-WebEngine

Exit code 0 with the JSON on stdout when the page loaded; 3 when no browser could start
(missing Qt WebEngine or system libraries), so tests can skip rather than fail.
"""

from __future__ import annotations

import os
import sys

PAGE_FACTS = """JSON.stringify({
  title: document.title,
  verdict: (document.getElementById('verdict') || {}).innerText || null,
  images: Array.from(document.images).map(i => ({alt: i.alt, complete: i.complete, width: i.naturalWidth, height: i.naturalHeight})),
  headings: Array.from(document.querySelectorAll('h2')).map(h => h.innerText),
  retrieval: Array.from(document.querySelectorAll('#retrieval tr')).map(r => Array.from(r.cells).map(c => c.innerText))
})"""


def main(path: str, timeout_ms: int = 60000) -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ.setdefault("QTWEBENGINE_CHROMIUM_FLAGS", "--no-sandbox --disable-gpu --disable-logging --log-level=3")
    os.environ.setdefault("QT_LOGGING_RULES", "*=false")
    try:
        from PyQt6.QtCore import QTimer, QUrl
        from PyQt6.QtWebEngineWidgets import QWebEngineView
        from PyQt6.QtWidgets import QApplication
    except ImportError as exc:
        print(f"no browser: {exc}", file=sys.stderr)
        return 3
    app = QApplication([sys.argv[0]])
    view = QWebEngineView()
    outcome = {"code": 3}

    def loaded(ok: bool) -> None:
        if not ok:
            print(f"the browser could not load {path}", file=sys.stderr)
            outcome["code"] = 1
            app.quit()
            return

        def facts(value) -> None:
            print(value)
            outcome["code"] = 0
            app.quit()

        # give data-URI images a moment to decode before reading their sizes
        QTimer.singleShot(1000, lambda: view.page().runJavaScript(PAGE_FACTS, facts))

    view.loadFinished.connect(loaded)
    view.load(QUrl.fromLocalFile(os.path.abspath(path)))
    QTimer.singleShot(timeout_ms, app.quit)
    app.exec()
    return outcome["code"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""One dashboard page kept open in Debian's headless Chromium, for the burn-down's --dashboard.

    python bench/_dashboard_page.py URL VIEW

Prints "ready" once the view is drawn (the live view: connected), then keeps the page open
until its standard input closes.
"""

from __future__ import annotations

import sys

CHROMIUM = "/usr/bin/chromium"


def main() -> None:
    url, view = sys.argv[1], sys.argv[2]
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(f"{url}/ui/#/{view}")
        page.wait_for_selector(".live-status.connected" if view == "live" else f'main[data-view="{view}"]')
        print("ready", flush=True)
        sys.stdin.read()
        browser.close()


if __name__ == "__main__":
    main()

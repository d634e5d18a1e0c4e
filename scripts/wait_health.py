"""Wait up to 5 minutes for http://127.0.0.1:PORT/health to answer 200; exit 1 if it never does.

    python3 scripts/wait_health.py 8090
"""

import sys
import time
import urllib.request

for _ in range(600):
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2).status == 200:
            sys.exit(0)
    except Exception:
        pass
    time.sleep(0.5)
sys.exit(1)

"""Wait up to 5 minutes for http://127.0.0.1:PORT/health to answer 200; exit 1 if it never does, or
as soon as process PID (optional: the server's) has exited.

    python3 scripts/wait_health.py 8090 [PID]
"""

import os
import sys
import time
import urllib.request

pid = int(sys.argv[2]) if len(sys.argv) > 2 else None
for _ in range(600):
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2).status == 200:
            sys.exit(0)
    except Exception:
        pass
    if pid is not None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit(1)  # the server is gone: it will not come up
        except PermissionError:
            pass
    time.sleep(0.5)
sys.exit(1)

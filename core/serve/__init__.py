"""`outrider serve`: an OpenAI-compatible HTTP server over one assembled runner.

The model is assembled once at start-up; up to `-np` generations run together in one worker thread, further
requests wait in a bounded queue (`engine.py`). Requests are validated into plain settings
(`requests.py`), answered in OpenAI's JSON and server-sent-event formats (`app.py`), and counted in
Prometheus metrics named after vLLM's (`metrics.py`). Stop strings are matched on the decoded text
(`stop_text.py`).
"""

from outrider.serve.app import create_app, run_server

__all__ = ["create_app", "run_server"]

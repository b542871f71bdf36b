"""A stand-in for an SGLang server's memory verbs, at its HTTP boundary, for machines without
CUDA (the memory saver needs it). It keeps SGLang 0.5.23's rules as its scheduler writes them
(``scheduler_components/weight_updater.py``): release only when idle (paused), release adds
the memory tags to ``offload_tags`` and resume removes them (a tag never released: KeyError,
the server's 500), and weights are not written while released. Every call and its answer is
appended to the log file as one line.

python sglang_memory_fake.py LOG PORT
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOG, PORT = sys.argv[1], int(sys.argv[2])
TAGS = ("kv_cache", "weights", "cuda_graph")
state = {"paused": False, "offload_tags": set()}


def verb(path: str) -> tuple[int, str]:
    if path == "/pause_generation":
        state["paused"] = True
    elif path == "/continue_generation":
        state["paused"] = False
    elif path == "/release_memory_occupation":
        if not state["paused"]:
            return 500, "release_memory_occupation should be called only when server is idle."
        state["offload_tags"].update(TAGS)
    elif path == "/resume_memory_occupation":
        for tag in TAGS:
            if tag not in state["offload_tags"]:
                return 500, f"KeyError: {tag!r}"
            state["offload_tags"].remove(tag)
    elif path == "/update_weights_from_disk":
        if "weights" in state["offload_tags"]:
            return 500, "weights are released: an update would write into freed memory"
    else:
        return 404, "unknown"
    return 200, ""


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # noqa: ANN002
        pass

    def reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self.reply(200, {})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        code, message = verb(self.path)
        with open(LOG, "a") as log:
            log.write(f"{self.path.strip('/')} {code}\n")
        self.reply(code, {"success": code == 200, "message": message})


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()

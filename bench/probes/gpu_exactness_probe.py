"""On the GPU machine: the exactness probe, and a daemon's answer to an exact request.

    python3 bench/probes/gpu_exactness_probe.py      (from the repository root)

What it found (H200, bundled model; bench/results/exactness_h200_tiny_qwen35.log): the verify
matches serial decode for neither rollback, so the daemon decodes exact greedy requests
serially there (status `exact_decode: serial`) while fast requests still speculate.
"""
import json, os, subprocess, sys, tempfile, time
sys.path.insert(0, os.getcwd())
from daemon.engine.model.loading import load_model
from daemon.engine.decoders.exactness import verify_matches_serial
lm = load_model("daemon/assets/tiny-qwen35")
print("decode_path", lm.decode_path)
print("probe capture", verify_matches_serial(lm, "capture"), "snapshot", verify_matches_serial(lm, "snapshot"))
run = tempfile.mkdtemp(); os.chmod(run, 0o700)
ep = f"ipc://{run}/c.sock"
log = open(f"{run}/d.log", "w")
p = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--endpoint", ep, "--log-format", "json"],
                     env=dict(os.environ, COUNCILD_RUNTIME_DIR=run), stdout=log, stderr=subprocess.STDOUT)
from protocol.client import Client
try:
    from protocol.readiness import wait_until_answering

    wait_until_answering(ep, p, timeout_s=120, log_path=f"{run}/d.log")  # a Pong: serving, not loading
    with Client(ep, timeout_s=60) as c:
        d = c.status().detail
        print("status exact_decode", d.get("exact_decode"), "decode_path", d.get("decode_path"))
        c.governor("pin_depth", 2)
        s = c.complete("def fibonacci(n):\n", max_tokens=48, speculation="off")
        e = c.complete("def fibonacci(n):\n", max_tokens=48, speculation="exact")
        f = c.complete("def fibonacci(n):\n", max_tokens=48, speculation="fast")
        print("exact == serial:", e.text == s.text, "exact speculation:", e.speculation, "fast drafted:", f.speculation and f.speculation.drafted)
finally:
    p.terminate(); p.wait(30)
for line in open(f"{run}/d.log"):
    if "speculation.exactness" in line or "model.loaded" in line:
        print(line.strip())

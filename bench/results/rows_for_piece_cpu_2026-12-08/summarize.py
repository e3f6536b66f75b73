import json, statistics, sys, subprocess
from pathlib import Path
d = Path(sys.argv[1]); pairs = sorted({int(p.stem.split('-')[1]) for p in d.glob('after-*.json')})
rows = []
def forwards(log):
    n = 0
    for line in open(log):
        try: e = json.loads(line)
        except ValueError: continue
        if e.get('event') == 'request.done': n += e.get('prefill_forwards') or 0
    return n
print('| pair | tok/s after / before | TTFT p50 ms after / before | TTFT p95 ms after / before | prefill forwards after / before | together forwards (rows) after / before |')
print('|---|---|---|---|---|---|')
for p in pairs:
    a, b = (json.load(open(d / f'{t}-{p}.json'))['arms']['fast'] for t in ('after', 'before'))
    fa, fb = (forwards(d / f'logs-{t}-{p}/daemon.log') for t in ('after', 'before'))
    ta, tb = (x['councild'][-1]['prefill']['together'] for x in (a, b))
    r = {'pair': p, 'tok_s': a['tok_s']['median'] / b['tok_s']['median'], 'p50': a['ttft_p50']['median'] / b['ttft_p50']['median'],
         'p95': a['ttft_p95']['median'] / b['ttft_p95']['median'], 'forwards': fa / fb}
    rows.append(r)
    print(f"| {p} | {a['tok_s']['median']:.1f} / {b['tok_s']['median']:.1f} | {a['ttft_p50']['median']*1e3:.0f} / {b['ttft_p50']['median']*1e3:.0f} | "
          f"{a['ttft_p95']['median']*1e3:.0f} / {b['ttft_p95']['median']*1e3:.0f} | {fa} / {fb} | {ta['forwards']} ({ta['rows']}) / {tb['forwards']} ({tb['rows']}) |")
for k in ('tok_s', 'p50', 'p95', 'forwards'):
    xs = [r[k] for r in rows]
    print(f"{k}: after/before median {statistics.median(xs):.3f} (range {min(xs):.3f}-{max(xs):.3f}), n={len(xs)}")

"""Colocated sync's run-to-run variance (docs/performance.md, "The host allocator"): whole runs of
tools/bench_vs_trl.py's long_tail setup, wall against CPU time (the run's processes, user + sys),
with and without OMP_WAIT_POLICY=PASSIVE, alternated.

    python tools/diagnose_sync_variance.py [REPEATS] [MODE]
"""
import os, sys, resource, time, tempfile, statistics, json
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE); sys.path.insert(0, os.path.dirname(HERE))
import bench_vs_trl as b
variants = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
import argparse
ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("repeats", nargs="?", type=int, default=3)
ap.add_argument("mode", nargs="?", default="sync", choices=sorted(b.MODES))
args = ap.parse_args()
reps, mode = args.repeats, args.mode
with tempfile.TemporaryDirectory() as d:
    work = b.make_work(d, "long_tail", 8, 0)
    for r in range(reps):
        for name, env in variants.items():
            old = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            ru0 = resource.getrusage(resource.RUSAGE_CHILDREN); t0 = time.perf_counter()
            rd = os.path.join(d, f"{name}_{r}"); os.makedirs(rd)
            st = b.run_project(work, "long_tail", mode, 8, 16, rd)
            wall = time.perf_counter() - t0; ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
            sys_t = ru1.ru_stime - ru0.ru_stime
            for k, v in old.items():
                if v is None: os.environ.pop(k, None)
                else: os.environ[k] = v
            print(f"{mode} {name} rep {r}: wall {wall:.1f} s, cpu {cpu:.1f} s (sys {sys_t:.1f}), cpu/wall {cpu/wall:.2f}, "
                  f"steps {' '.join(f'{x:.2f}' for x in st)}", flush=True)

# Kernels of profiled forward passes from an ncu CSV (ncu --metrics gpu__time_duration.sum --csv --print-units base),
# grouped by name, grid and block, slowest first.
#   python3 bench/gpu/ncu_step_summary.py ncu.csv            one decode step of bench_model --batches 1 --steps 1:
#                                                            the kernels between the 2nd and 3rd argmax launch
#   python3 bench/gpu/ncu_step_summary.py --forwards ncu.csv every forward captured (ncu --profile-from-start off
#                                                            around bench_model --model v4-flash-slice --profile):
#                                                            one summary per forward, each starting at its
#                                                            embedding lookup (gather_rows_kernel)
import csv, collections, re, sys

args = [a for a in sys.argv[1:] if not a.startswith('--')]
lines = [l for l in open(args[0]) if l.startswith('"')]
rows = list(csv.reader(lines))[1:]
ks = [(int(r[0]), r[4], int(r[14].replace(',', '')), r[8], r[7]) for r in rows]


def short(n):
    n = re.sub(r'\(.*', '', n)
    n = n.replace('void ', '').replace('deepinfer::<unnamed>::', '').replace('deepinfer::kernels::cuda::', '')
    return n[:70]


def summary(seg, title):
    print(f'== {title}: kernels {len(seg)}, sum {sum(k[2] for k in seg) / 1e3:.1f} us')
    agg = collections.defaultdict(lambda: [0, 0])
    for k in seg:
        key = (short(k[1]), k[3], k[4])
        agg[key][0] += 1
        agg[key][1] += k[2]
    for key, (c, t) in sorted(agg.items(), key=lambda x: -x[1][1])[:40]:
        print(f"{t / 1e3:9.1f} us {c:4d}x  avg {t / c / 1e3:7.2f}  {key[0]} grid{key[1]} blk{key[2]}")


if '--forwards' in sys.argv:
    starts = [i for i, k in enumerate(ks) if 'gather_rows' in k[1]] + [len(ks)]
    for n, (a, b) in enumerate(zip(starts, starts[1:])):
        summary(ks[a:b], f'forward {n + 1}')
else:
    idx = [i for i, k in enumerate(ks) if 'argmax' in k[1]]
    summary(ks[idx[1] + 1:idx[2] + 1], 'decode step')

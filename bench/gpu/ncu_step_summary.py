# One decode step's kernels from an ncu CSV (ncu --metrics gpu__time_duration.sum --csv --print-units base
# bench_model --batches 1 --steps 1 ...): the kernels between the 2nd and 3rd argmax launch (the timed step),
# grouped by name, grid and block, slowest first. Usage: python3 bench/gpu/ncu_step_summary.py ncu.csv
import csv,collections,re,sys
lines=[l for l in open(sys.argv[1]) if l.startswith('"')]
rows=list(csv.reader(lines))[1:]
ks=[(int(r[0]),r[4],int(r[14].replace(',','')),r[8],r[7]) for r in rows]
idx=[i for i,k in enumerate(ks) if 'argmax' in k[1]]
a,b=idx[1]+1,idx[2]+1
seg=ks[a:b]
print('kernels',len(seg),'sum us',sum(k[2] for k in seg)/1e3)
agg=collections.defaultdict(lambda:[0,0])
def short(n):
    n=re.sub(r'\(.*','',n); n=n.replace('void ','').replace('deepinfer::<unnamed>::','')
    return n[:70]
for k in seg:
    key=(short(k[1]),k[3],k[4]); agg[key][0]+=1; agg[key][1]+=k[2]
for key,(c,t) in sorted(agg.items(),key=lambda x:-x[1][1]):
    print(f"{t/1e3:8.1f} us {c:4d}x  avg {t/c/1e3:6.2f}  {key[0]} grid{key[1]} blk{key[2]}")

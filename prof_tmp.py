import cProfile, pstats, time, tempfile
from pathlib import Path
from bench.streaming_read import build_shard
from persist_lib import PersistClient, PersistConfig
import pyarrow as pa
root = Path(tempfile.mkdtemp())
blob, cons, shard, as_of, info = build_shard(root, 2_000_000, 8, 2 << 20)
print(info)
c = PersistClient.open(blob, cons, PersistConfig.for_tests())
r = c.open_leased_reader(shard, pa.schema([("k", pa.int64())]), pa.schema([("v", pa.int64())]))
t0=time.perf_counter(); t = r.snapshot(as_of, memory_budget=1<<40); print("whole", time.perf_counter()-t0, t.num_rows)
def go():
    n=0
    with r.snapshot_batches(as_of, memory_budget=32<<20) as s:
        for b in s: n+=b.num_rows
    print(s.stats)
    return n
t0=time.perf_counter(); cProfile.run("go()", "/tmp/wtmem_prof"); print("stream", time.perf_counter()-t0)
pstats.Stats("/tmp/wtmem_prof").sort_stats("cumulative").print_stats(30)

"""A healing sender's stream alone (``Courier.stream``), a fresh pair of processes per variant on
loopback: rank 0 sends 24 files of 18.4 MB mapped from /dev/shm and hashes each (xxh3: the check
that hands a file to its own restore, ``store.tiers.healing._sender``) either in ``fill``, before
the file's sends are posted (variant ``fill``: the order before session 47's send47), or in
``meanwhile``, once every send is posted (``meanwhile``: the order now); rank 1 receives, xxh3 on
take. Prints the sender's seconds until its last send was posted, its stream wall and training
thread CPU, and the receiver's stream wall.

    .venv/bin/python bench/bench_stream_sender.py fill,meanwhile,fill,meanwhile
"""
import json, mmap, os, subprocess, sys, time
import torch, torch.distributed as dist, xxhash

FILES, SIZE = 24, 18_400_000
SHM = os.environ.get("BENCH_STREAM_SHM") or f"/dev/shm/llmtailor-bench-stream-{os.getpid()}"

def worker(rank, variant):
    import llmtailor.distributed.courier as courier
    dist.init_process_group("gloo", rank=rank, world_size=2)
    c = courier.Courier.open(timeout=60)
    names = [(f"f{i}", SIZE) for i in range(FILES)]
    dist.barrier()
    maps, hashed, kept, last = [], [], [], [0.0]
    send = c._send
    def timed_send(*a):
        work = send(*a); last[0] = time.perf_counter(); return work
    c._send = timed_send
    def fill(dst, name, into):
        with open(f"{SHM}/{name}", "rb") as f:
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        if variant == "fill":
            hashed.append(xxhash.xxh3_64_hexdigest(m))
        else:
            maps.append(m)
        return m
    def meanwhile():
        hashed.extend(xxhash.xxh3_64_hexdigest(m) for m in maps)
    def take(src, name, content):
        kept.append((xxhash.xxh3_64_hexdigest(content), content))
    cpu, wall = time.thread_time(), time.perf_counter()
    if rank == 0:
        c.stream({1: names}, fill, [], take, meanwhile)
    else:
        c.stream({}, fill, [0], take)
    end = time.perf_counter()
    dist.barrier()
    print(json.dumps({"rank": rank, "wall": end - wall, "cpu": time.thread_time() - cpu,
                      "posted": last[0] - wall if rank == 0 else None, "hashed": len(hashed)}), flush=True)
    os._exit(0)

if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        torch.set_num_threads(1); worker(int(os.environ["RANK"]), sys.argv[2]); sys.exit(0)
    os.makedirs(SHM, exist_ok=True)
    for i in range(FILES):
        with open(f"{SHM}/f{i}", "wb") as f:
            f.write(os.urandom(SIZE))
    for variant in sys.argv[1].split(","):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 500),
               "OMP_NUM_THREADS": "1", "BENCH_STREAM_SHM": SHM}
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", variant], env={**env, "RANK": str(r)},
                                  stdout=subprocess.PIPE, text=True) for r in range(2)]
        s, r = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
        print(f"{variant:9}: sender last send posted at {s['posted']:.3f} s, stream wall {s['wall']:.3f} s, thread CPU "
              f"{s['cpu']:.3f} s ({s['hashed']} hashed); receiver stream wall {r['wall']:.3f} s; load {os.getloadavg()[0]:.1f}",
              flush=True)
    subprocess.run(["rm", "-rf", SHM])

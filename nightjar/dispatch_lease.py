"""Direct dispatch: the gateway puts a job straight into a worker's inbox under the scheduler's lease.

Through the scheduler a job waits for one more process to wake, read it and write it on, and the
scheduler spends CPU on every request (BENCHMARKS.md, "Pipeline overhead"). So the scheduler,
still the one that decides who may take work, publishes a lease table of the live workers'
capacity instead, and the gateway's one enqueue script picks a worker from it or falls back to
the requests stream (``DirectDispatch``).
"""

from __future__ import annotations

from nightjar.keys import Keys
from nightjar.messages import Heartbeat

ASSIGNMENT_TTL_S = 24 * 3600.0  # a leaked assignment record disappears after this (scheduler and gateway)

# KEYS: requests stream, lease table, the job's assignment hash, then for each declared worker
# its heartbeat, assignment set and inbox. ARGV: job bytes, request id, now (unix ms),
# assignment TTL (ms), then the declared workers' ids, in the order of their KEYS. Returns the
# worker's id, nil if queued, or the lease table's workers when it names one not declared
# (then nothing was written: the caller declares them and calls again).
_ENQUEUE = """
local function queue()
  redis.call('XADD', KEYS[1], '*', 'job', ARGV[1])
  return false
end
if redis.call('XLEN', KEYS[1]) > 0 then return queue() end
local leases = redis.call('HGETALL', KEYS[2])
local declared = {}  -- worker id -> index of its heartbeat in KEYS
for i = 5, #ARGV do declared[ARGV[i]] = 4 + 3 * (i - 5) end
for i = 1, #leases, 2 do
  if not declared[leases[i]] then
    local names = {}
    for j = 1, #leases, 2 do names[#names + 1] = leases[j] end
    return names
  end
end
local best, best_free, best_kv, best_k
for i = 1, #leases, 2 do
  local worker, k = leases[i], declared[leases[i]]
  local max_running, kv_free, kv_total = string.match(leases[i + 1], '^(%d+) (%d+) (%d+)$')
  local hb = max_running and redis.call('GET', KEYS[k])
  local ok, beat = false, nil
  if hb then ok, beat = pcall(cmsgpack.unpack, hb) end
  if ok and type(beat) == 'table' and beat.draining ~= true then
    max_running, kv_free, kv_total = tonumber(max_running), tonumber(kv_free), tonumber(kv_total)
    local slots = (max_running - redis.call('SCARD', KEYS[k + 1])) / math.max(1, max_running)
    local free = math.min(slots, kv_free / math.max(1, kv_total))
    if best == nil or free > best_free or (free == best_free and (kv_free > best_kv
        or (kv_free == best_kv and worker > best))) then
      best, best_free, best_kv, best_k = worker, free, kv_free, k
    end
  end
end
if best == nil then return queue() end
redis.call('XADD', KEYS[best_k + 2], '*', 'job', ARGV[1])
redis.call('HSET', KEYS[3], 'worker', best, 'job', ARGV[1], 'assigned_unix_ms', ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
redis.call('SADD', KEYS[best_k + 1], ARGV[2])
return best
"""


def lease_entry(hb: Heartbeat) -> str:
    """A worker's row in the lease table (what the enqueue script parses)."""
    return f"{max(0, hb.max_running)} {max(0, hb.kv_blocks_free)} {max(0, hb.kv_blocks_total)}"


class DirectDispatch:
    """The gateway's enqueue: one script call that leases a worker or queues the job.

    Every ``heartbeat_check_s`` the scheduler writes each live worker's max_running and free KV
    blocks from its heartbeat to the lease table, with a short TTL (``lease_entry``). The script

    - falls back to the requests stream (and so to the scheduler) when jobs are already waiting
      there (first come, first served), when there is no table (no scheduler for a TTL), or when
      no worker in it still has a heartbeat key that is not draining (the table is up to a check
      old, and a worker that got SIGTERM since must get nothing new: the script reads the flag
      from the heartbeat itself);
    - otherwise picks the worker the scheduler would (scheduler_svc.capacity: the tightest of free
      slots and free KV, ties to more free KV blocks, then the larger id), with the slots counted
      live from the worker's assignment set rather than from its last heartbeat;
    - writes what the scheduler's own dispatch writes (inbox entry, assignment hash with its TTL,
      the worker's assignment set), so re-dispatch after a worker dies, cancels and the worker's
      bookkeeping treat a leased job exactly like a scheduled one.

    Every key the script touches is declared in KEYS, as Redis Cluster requires: the gateway
    passes the heartbeat, assignment set and inbox of each worker it last saw in the table, and a
    table that names another worker makes the script write nothing and return the table's
    workers, so the next call declares them (one extra round trip per change of the worker set).
    On Cluster all of them must also share one slot: a stack's key prefix is then a hash tag
    (``{nj}``, nightjar.keys), which is what the scheduler's MULTI blocks, the worker's output
    script and the gateway's one XREAD over many output streams need too (docs/reliability.md,
    "Redis Cluster").
    """

    def __init__(self, redis, keys: Keys, assignment_ttl_s: float) -> None:
        self._redis = redis
        self._script = redis.register_script(_ENQUEUE)  # EVALSHA, re-sent with EVAL after a Redis restart
        self._keys = keys
        self._workers: tuple[str, ...] = ()  # the lease table's workers when last seen: their keys are declared
        self._assignment_ttl_ms = int(assignment_ttl_s * 1000)

    async def enqueue(self, request_id: str, job: bytes, now_ms: int) -> str | None:
        """The worker the job went to directly, or None when it went on the requests stream."""
        k = self._keys
        for _ in range(3):  # a changed table costs one more call; three changes in a row: queue it
            workers = self._workers
            per_worker = [key for w in workers for key in (k.heartbeat(w), k.worker_assignments(w), k.inbox(w))]
            reply = await self._script(keys=[k.requests, k.leases, k.assignment(request_id), *per_worker],
                                       args=[job, request_id, now_ms, self._assignment_ttl_ms, *workers])
            if not isinstance(reply, list):
                return reply.decode() if isinstance(reply, bytes) else reply
            self._workers = tuple(w.decode() if isinstance(w, bytes) else w for w in reply)
        await self._redis.xadd(k.requests, {b"job": job})
        return None

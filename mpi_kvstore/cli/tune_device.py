"""Device buffers for ``python -m mpi_kvstore tune``: each GPU transport every rank can use
(comm/transports/), timed on CuPy float32 buffers for allreduce and for each other
collective (tuning.OPS), and the transport each size keeps: the one gpu_transport=auto
would take unless another is faster by the margin. The table's ``device`` rows hold
allreduce's choice, its ``device_ops`` rows the other collectives'.

CuPy is imported only here and only where every rank has a GPU (:func:`present`).
"""
from ..comm import transports
from ..comm.fusion import pieces
from ..comm.mpiabi import MPI
from ..comm.tuning import OPS
from ..errors import ConfigError

__all__ = ['present', 'built', 'allreduce_rows', 'ops_rows', 'check', 'against_each', 'pick']

# Another transport (or algorithm: tune.py's host picks take this rule too) replaces the
# default only where it is this much faster.
MARGIN = 0.97


def present():
    """Every rank sees a GPU through CuPy (agreed, so every rank times device buffers or
    none does)."""
    try:
        import cupy  # CuPy only where a GPU is used
        mine = int(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        mine = 0
    return bool(MPI.COMM_WORLD.allreduce(mine, op=MPI.MIN))


def built(comm, say):
    """Collective: every GPU transport that every rank can use (transports.decide's rules),
    built, and the one gpu_transport=auto would take. -> ({name: Transport}, default)"""
    import cupy  # CuPy only where a GPU is used
    device = comm.rank % cupy.cuda.runtime.getDeviceCount()
    usable, shared = transports.agreed(comm, device)
    runnable = []
    for name in transports.REGISTRY:
        try:
            runnable.append(transports.decide(name, usable, shared, concurrent=False))
        except ConfigError as err:
            say('GPU transport %s not timed: %s' % (name, err))
    default = transports.decide('auto', usable, shared, concurrent=False)
    return {name: transports.REGISTRY[name](comm, device) for name in runnable}, default


def _zeros(made, count):
    import cupy  # CuPy only where a GPU is used
    with cupy.cuda.Device(next(iter(made.values())).device):
        return cupy.zeros(max(count, 1), cupy.float32)


def _finished(transport, run):
    """``run(transport)`` on the transport's device and stream, finished."""
    with transport.scope():
        run(transport)
        transport.finish()


def _runs(op, comm, made, nbytes):
    """{transport name: run} of ``op`` ('allreduce' or a key of OPS) on device float32
    buffers of ``nbytes``, one set of buffers for every transport, as tune's host ops."""
    count = max(nbytes // 4, comm.size)
    buf = _zeros(made, count)
    counts, displs = pieces(count, comm.size)
    if op == 'allreduce':
        call = lambda t: t.allreduce(buf)                      # noqa: E731
    elif op == 'broadcast':
        call = lambda t: t.bcast(buf, 0)                       # noqa: E731
    elif op == 'allgather':
        call = lambda t: t.allgather(buf, counts, displs)      # noqa: E731
    elif op == 'reducescatter':
        piece = _zeros(made, counts[comm.rank])
        call = lambda t: t.reduce_scatter(buf, piece, counts)  # noqa: E731
    else:   # alltoall: whole chunks
        send = buf[:count - count % comm.size]
        recv = _zeros(made, send.size)
        call = lambda t: t.alltoall(send, recv)                # noqa: E731
    return {name: (lambda t=t: _finished(t, call)) for name, t in made.items()}


def pick(times_ms, default):
    """The GPU transport for one size: ``default`` (gpu_transport=auto's) unless another is
    faster by the margin."""
    fastest = min(times_ms, key=times_ms.get)
    return fastest if times_ms[fastest] < MARGIN * times_ms[default] else default


def _op_rows(op, comm, made, default, sizes, trials, interleaved, say):
    """``op`` timed through each transport per size. -> ([(bytes, transport)], {size: {name:
    ms}})"""
    rows, measured = [], {}
    for nbytes in sizes:
        times = interleaved(comm, _runs(op, comm, made, nbytes), trials)
        ms = measured[str(nbytes)] = {name: t * 1e3 for name, t in times.items()}
        rows.append((nbytes, pick(ms, default)))
        say('%-13s %10d B  GPU  ' % (op, nbytes) + '  '.join(
            '%s %.3f ms%s' % (n, t, ' *' if n == rows[-1][1] else '') for n, t in ms.items()))
    return rows, measured


def allreduce_rows(comm, made, default, sizes, trials, interleaved, say):
    """Allreduce through each transport: the table's ``device`` rows. ``interleaved``:
    tune's timer, (comm, {name: run}, trials) -> {name: seconds}.
    -> ([(bytes, transport)], {size: {name: ms}})"""
    rows, measured = _op_rows('allreduce', comm, made, default, sizes, trials, interleaved,
                              say)
    say('GPU transports chosen by size (gpu_transport=auto would take %s): %s'
        % (default, ', '.join('%d B %s' % row for row in rows)))
    return rows, measured


def ops_rows(comm, made, default, sizes, trials, interleaved, say):
    """Each other collective (OPS) through each transport: the table's ``device_ops`` rows.
    -> ({op: [(bytes, transport)]}, {op: {size: {name: ms}}})"""
    rows, measured = {}, {}
    for op in OPS:
        rows[op], measured[op] = _op_rows(op, comm, made, default, sizes, trials,
                                          interleaved, say)
    return rows, measured


def check(comm, tuned, made, sizes, trials, interleaved, say):
    """The table's device allreduce (a Comm with the table) against each single transport,
    in pairs, as the host check. -> the slowest size's ratio to its best single transport"""
    worst = 0.0
    for nbytes in sizes:
        singles_runs = _runs('allreduce', comm, made, nbytes)
        buf = _zeros(made, max(nbytes // 4, 1))

        def table_run(buf=buf):
            tuned.allreduce(buf)
            buf.device.synchronize()
        best, table_s, best_s = against_each(comm, interleaved, table_run, singles_runs, trials)
        worst = max(worst, table_s / best_s)
        say('%10d B  GPU  table (%s) %.3f ms, best single (%s) %.3f ms: %.2fx'
            % (nbytes, tuned.device_transport(buf.device.id, buf.nbytes).name,
               table_s * 1e3, best, best_s * 1e3, table_s / best_s))
    return worst


def against_each(comm, interleaved, table_run, runs, trials):
    """The table's dispatch timed in a pair with each single run of ``runs`` ({name: fn}),
    each order as often, so what ran before cannot bias either -> (the fastest single's
    name, the table's seconds in its pair, that single's seconds). The host check
    (tune.py) and the device check share it."""
    mine, singles = {}, {}
    for name, run in runs.items():
        paired = interleaved(comm, {'table': table_run, name: run}, trials)
        mine[name], singles[name] = paired['table'], paired[name]
    best = min(singles, key=singles.get)
    return best, mine[best], singles[best]

"""Collectives by name, outside the key/value contract: on a user's array (the entry point
of the Horovod-style helpers, functional.py), on a Python function of the communicator,
and the barrier. Each goes out in collective order through the store's :class:`job.Job`.
"""
import mxnet as mx
import numpy as np

from .. import debug
from ..comm.collective import Collective, factor_sig, signature
from ..comm.host import PolledComm
from ..engine.arrays import copy_of, dense_meta
from ..engine.records import Prepared
from .contract import check_root
from .namecache import NameCache
from .repeats import (
    HIT,
    HIT_COPY,
    HIT_UNNAMED,
    Again,
    Copy,
    Unnamed,
    check_arrays,
    copier,
    distinct_dense,
)

__all__ = ['Collectives', 'ARRAY_KINDS']

ARRAY_KINDS = ('allreduce', 'bcast', 'reducescatter', 'allgather')
_SIGNED_LIMIT = 4096   # names whose signature is kept (cleared when reached)
# the scaling of a plain call, the default key under which records are found again
_PLAIN = (1.0, 1.0)


class Collectives:
    """The named collectives of one store (``MPIKVStore.collectives``; MXNet's
    ``_barrier`` too). ``buffers``: the staging buffers of array collectives, by name."""

    def __init__(self, job, config, size):
        self._job, self._size = job, size
        # array collectives' staging buffers, least recently used first out (names may be
        # new every step)
        self.buffers = NameCache(config.name_cache_capacity)
        # allreduce in place where the array's memory is row-major (option zero_copy)
        self._in_place = config.zero_copy
        self._signed = {}   # name -> (shape, dtype, place, signature) of its last call
        # name -> its last in-place allreduce (repeats.Again), taken again by a call on the very
        # same array with the same average; as many as the staging buffers, least recently
        # used out (an entry holds its array)
        self._again = NameCache(config.name_cache_capacity)
        # name -> its last out-of-place allreduce (repeats.Copy), taken again by a call on the very
        # same input with the same average (again_copy); as many, least recently used out
        self._copies = NameCache(config.name_cache_capacity)
        # a group's name -> its last in-place allreduce (repeats.Again of the whole list), whose
        # tensors share no storage: taken again as one engine op (again_group)
        self._groups = NameCache(config.name_cache_capacity)
        # the in-place cache's own dict (name -> [Again, user]), which again() reads and
        # moves to the end itself: NameCache.get's frame is a fifth of that path (issue 43)
        self._again_entries = self._again._entries
        # an unnamed call's tensor -> its last in-place allreduce (repeats.Unnamed)
        self._unnamed = Unnamed(config.name_cache_capacity)
        # On an elastic world a function of the communicator gets its polled form, whose
        # waits end when a peer is lost (comm.host.PolledComm); chosen once, here.
        self._polled_us = config.progress_sleep_us if job.world is not None else None

    def array(self, kind, name, tensor, root=0, average=False, unit=1):
        """Run one collective on ``tensor`` in place, in collective order: 'allreduce' (the
        sum, or the mean with ``average``), 'bcast' (root's value), 'reducescatter' (this
        rank's share of the flat tensor gets the sum, or the mean; shares are cut in whole
        ``unit``s of elements, fusion.pieces) or 'allgather' (every share gets its owner's
        values); return ``tensor``. The entry point of the Horovod-style helpers
        (functional.py); ``name`` identifies the collective across ranks, as a key does.

        The data travels through a staging buffer the store keeps per (name, shape, dtype,
        context), written and read by MXNet's own copy operator: user arrays (weights after
        an inference forward) may sit in an MKLDNN layout whose bytes are not row-major.
        It keeps ``name_cache_capacity`` of them, dropping the least recently used whose
        collective is done (namecache.NameCache).
        """
        if kind not in ARRAY_KINDS:
            raise ValueError('collectives.array: kind must be one of %s, not %r'
                             % (', '.join(ARRAY_KINDS), kind))
        if kind == 'allreduce':
            self.allreduce([name], [tensor], average)
            return tensor
        if kind == 'bcast':
            check_root(root, self._size)
        self._job.begin()
        key = (name, tensor.shape, np.dtype(tensor.dtype), str(tensor.context))
        buf = self.buffers.get(key)
        if buf is None:
            buf = mx.nd.zeros(tensor.shape, ctx=tensor.context, dtype=tensor.dtype)
        tensor.copyto(buf)
        req = Collective(kind, name, np.dtype(tensor.dtype), tensor.shape, array=buf, root=root,
                         average=average, unit=unit)
        self._job.submit([req], 0)
        # Dropped from the cache only once req is done: the collective reads and writes buf
        # through a raw view. MXNet's own copies hold buf themselves.
        self.buffers.keep(key, buf, req)
        buf.copyto(tensor)
        return tensor

    def allreduce(self, names, tensors, average=False, again=True, group=None, sources=None,
                  factors=None, repeat_as=None, scale=None):
        """Sum (the mean with ``average``) each tensor over the ranks, in place; ``names[i]``
        identifies tensor i's collective across ranks. One engine op per tensor: two tensors
        of one list may be views of one array, which share an engine variable, and an op
        that writes one variable twice never runs. The negotiated designs still agree and
        fuse those ready together. A ``group`` of dense tensors of distinct storage, in
        place, is one engine op, as its repeats (:meth:`again_group`) are.

        A dense tensor is reduced where it is, with the option ``zero_copy``, as
        kv.pushpull reduces its values (an array MXNet holds in an MKLDNN layout then fails
        with ArrayLayoutError on this rank, and the others learn why), and a name called
        again with the same shape, dtype and place reuses its signature (debug counter
        ``named``: 'hit', else 'miss'). A sparse tensor, or one given twice in the list,
        travels through a staging buffer as :meth:`array`'s other kinds do ('staged').

        A lone tensor called again under its name, the very same array with the same
        ``average``, takes the prepared path (debug counter ``fastpath``: 'hit', else
        'miss'): its request renewed from the last one's (Collective.renewed), with the
        engine's prepared call (engine.records.Prepared). ``again=False``: the tensors are fresh copies, never
        called again (kept for nothing). ``group``: the name of the list as a whole (a
        grouped allreduce), kept for :meth:`again_group` where every tensor went in place
        and no two share storage. ``sources``: of an out-of-place call (``again=False``), the
        arrays the tensors are copies of (:func:`engine.arrays.copy_of`), each kept with its
        request for :meth:`again_copy` where its copy went in place.

        ``average`` may be a list (one a tensor), and ``factors`` a list of scale factors,
        each folded into its tensor's reduction (Collective.factor; None: 1.0 each).
        ``repeat_as``: (mean, scale), the arguments under which :meth:`again`,
        :meth:`again_group` and :meth:`again_copy` find the records of this call again
        (horovod.ops: its op and scale factors); by default (``average``, plain) where
        ``average`` is a bool, else never. ``scale``: the caller's (prescale, postscale),
        where it gave any, in each request (Collective.scale, its signature).
        """
        if repeat_as is None:
            repeat_as = (average, _PLAIN) if average.__class__ is bool else (None, None)
        each = average.__class__ is list
        self._job.begin()
        # A group whose tensors are all dense, in place and of distinct storage goes as ONE
        # engine op, on its first call as on its repeats (again_group): the chained design
        # agrees on each op's collectives together, so a rank repeating the group (one op)
        # beside a rank on this path (one op a tensor, as before) disagreed on the count and
        # their sequence numbers parted: the rest waited for partners that never came.
        one_op = (group is not None and len(tensors) > 1 and self._in_place
                  and distinct_dense(tensors))
        # records (repeats.Again, repeats.Copy) kept only once every request is submitted: a call
        # rejected partway (a bad tensor in the list) leaves none of a call that never ran,
        # so the names' next call takes the path it would have taken without it
        reqs, staged, seen, made, records = [], [], set(), [], []
        for i, (name, tensor) in enumerate(zip(names, tensors)):
            try:
                handle = tensor.handle.value
            except AttributeError:
                check_arrays(names, tensors)
                raise
            avg = average[i] if each else average
            factor = 1.0 if factors is None else factors[i]
            if one_op:   # every tensor in place (distinct_dense): no record of its own
                debug.count('fastpath', 'miss')   # the full path, as _repeat counts it
                req = self._in_place_request(name, tensor, dense_meta(tensor), avg, factor,
                                             scale)
                reqs.append(req)
                made.append(req)
                continue
            if handle not in seen:
                found = self._repeat(name, tensor, avg, factor, scale)
                if found is not None:
                    seen.add(handle)
                    reqs.append(found)
                    made.append(found.models[0])
                    continue
            meta = dense_meta(tensor) if self._in_place else None
            if meta is not None and handle not in seen:
                seen.add(handle)
                req = self._in_place_request(name, tensor, meta, avg, factor, scale)
                if again:
                    records.append((self._again, name,
                                    Again(tensor, req, self._job.design, repeat_as)))
                elif sources is not None and sources[i].__class__ is mx.nd.NDArray:
                    records.append((self._copies, name,
                                    Copy(sources[i], req, self._job.design, repeat_as)))
                reqs.append([req])
                made.append(req)
                continue
            debug.count('named', 'staged')
            key = ('allreduce', name, tensor.shape, np.dtype(tensor.dtype), str(tensor.context))
            buf = self.buffers.get(key)
            if buf is None:
                buf = mx.nd.zeros(tensor.shape, ctx=tensor.context, dtype=tensor.dtype)
            tensor.copyto(buf)
            reqs.append([Collective('allreduce', name, np.dtype(tensor.dtype), tensor.shape,
                                    array=buf, average=avg, factor=factor, scale=scale)])
            staged.append((key, buf, reqs[-1][0], tensor))
        # kept before the design numbers the requests: their models are unnumbered
        if one_op:
            reqs = [reqs]
            if again:
                records.append((self._groups, group,
                                Again(tensors, made, self._job.design, repeat_as)))
        job = self._job
        if len(reqs) > 1:   # several engine ops: the design may have to fail them together
            job.design.call(sum(len(r.models) if r.__class__ is Again else len(r)
                                for r in reqs))
        for req in reqs:
            if req.__class__ is Again:   # a repeat: its models renewed by the job
                job.again(req.prepared, req.models, 0)
            else:
                job.submit(req, 0)
        for cache, name, record in records:
            cache.keep(name, record)
        for key, buf, req, tensor in staged:
            self.buffers.keep(key, buf, req)   # see array()
            buf.copyto(tensor)
        return tensors

    def again_group(self, name, tensors, mean, scale=_PLAIN):
        """:meth:`again` of a grouped allreduce (``name``: the group's) whose tensors are
        the very arrays of its last call, in place and sharing no storage: one engine op for
        the whole list. True once submitted; False: nothing was done."""
        known = self._groups.get(name)
        job = self._job
        if (known is None or known.average is not mean
                or (known.scale is not scale and known.scale != scale)
                or known.prepared.owner is not job.design
                or len(tensors) != len(known.tensor) or job.closed):
            return False
        for tensor, was, handle in zip(tensors, known.tensor, known.handle):
            if tensor is not was or tensor.handle is not handle:
                return False
        errors = job.errors
        if errors.waiting:   # one test when nothing failed, not a call
            errors.raise_pending()
        debug.count_all(known.hits)
        repeat = job.again_direct   # as again()'s
        if repeat is None or not repeat(known.prepared, known.models, 0, job.pending):
            job.again(known.prepared, known.models, 0)
        return True

    def again(self, name, tensor, mean, scale=_PLAIN):
        """A lone allreduce of ``tensor`` under ``name`` on its prepared path, if it is
        the very array of the name's last in-place call (its handle too) and the reduction
        is the one prepared: the sum, or with ``mean`` the mean folded into it (a float
        dtype). True once submitted; False: nothing was done, the caller takes the full
        path (which also says what is wrong). One function, for Horovod's repeated calls
        (horovod.ops.allreduce_). ``scale``: the caller's scaling, as the full path's
        ``repeat_as`` keyed the record (horovod.ops: (prescale, postscale))."""
        entries = self._again_entries
        found = entries.get(name)
        if found is None:
            return False
        known, job = found[0], self._job
        # a prepared mean was folded (a float dtype); an integer one scales after: full path.
        # A closed store: the full path's begin says so.
        if (known.tensor is not tensor or known.average is not mean
                or (known.scale is not scale and known.scale != scale)
                or known.handle is not tensor.handle or known.prepared.owner is not job.design
                or job.closed):
            return False
        entries.move_to_end(name)   # the most recently used, as NameCache.get leaves it
        errors = job.errors
        if errors.waiting:   # one test when nothing failed, not a call
            errors.raise_pending()
        debug.count_all(HIT)
        # renewed by the design's one function (Job.again_direct), else by the job
        repeat = job.again_direct
        if repeat is None or not repeat(known.prepared, known.models, 0, job.pending):
            job.again(known.prepared, known.models, 0)
        return True

    def again_unnamed(self, tensor, mean, scale=_PLAIN):
        """:meth:`again` of an unnamed call (horovod.ops.allreduce_ without a name), whose
        record is found by the tensor rather than the name that every unnamed call shares:
        ranks call their unnamed tensors in the same order, and the agreement compares the
        signatures (name, shape, dtype) of the calls, whichever path made them (debug
        counters ``again``: 'unnamed', ``fastpath``: 'hit'). True once submitted; False:
        nothing was done, the caller takes the full path, then :meth:`remember_unnamed`."""
        entries = self._unnamed.entries
        known = entries.get(id(tensor))
        if known is None:
            return False
        job = self._job
        if (known.tensor is not tensor or known.average is not mean
                or (known.scale is not scale and known.scale != scale)
                or known.handle is not tensor.handle or known.prepared.owner is not job.design
                or job.closed):
            return False
        entries.move_to_end(id(tensor))
        errors = job.errors
        if errors.waiting:
            errors.raise_pending()
        debug.count_all(HIT_UNNAMED)
        repeat = job.again_direct   # as again()'s
        if repeat is None or not repeat(known.prepared, known.models, 0, job.pending):
            job.again(known.prepared, known.models, 0)
        return True

    def remember_unnamed(self, name, tensor):
        """After an unnamed call's full path under ``name``: its record (made there, where
        it went in place) kept for :meth:`again_unnamed` by ``tensor``, the least recently
        used dropped past name_cache_capacity entries or repeats._UNNAMED_BYTES of arrays."""
        found = self._again_entries.get(name)
        known = None if found is None else found[0]
        if known is None or known.tensor is not tensor or known.dtype is None:
            return
        self._unnamed.remember(tensor, known)

    def again_copy(self, name, tensor, mean, scale=_PLAIN):
        """:meth:`again` of an out-of-place allreduce (hvd.allreduce, functional.allreduce):
        a new NDArray of ``tensor``'s values summed over the ranks (with ``mean`` their mean,
        folded into the reduction), ``tensor`` left as it was, where ``tensor`` is the very
        array (its handle too) whose copy the name's last out-of-place call reduced in place
        with the same ``mean``. Its copy made by one engine op (engine.arrays.copy_of), its
        request renewed from that call's with the copy as its array: nothing asked of MXNet
        but the copy (debug counters ``again``: 'copy', and ``fastpath``: 'hit'; the full
        path counts a miss). The record holds the input weakly (repeats.Copy).
        None: nothing was done, the caller takes the full path (which also says what is
        wrong, and makes the record: ``sources`` of :meth:`allreduce`)."""
        known = self._copies.get(name)
        job = self._job
        # the very input: its handle object, alive (held weakly: repeats.Copy) and tensor's own
        # (getattr: anything else given under the name goes to the full path, which says why;
        # a dead input's reference answers None, as getattr does for one without a handle)
        handle = getattr(tensor, 'handle', None)
        if (known is None or handle is None or known.source() is not handle
                or known.average is not mean or (known.scale is not scale and known.scale != scale)
                or known.design is not job.design or job.closed):
            return None
        errors = job.errors
        if errors.waiting:   # one test when nothing failed, not a call
            errors.raise_pending()
        blank = known.blank
        if blank is None:
            out = copy_of(tensor)
        else:
            # copied at the push where tensor is readable then, so the collective pushed
            # on ``out`` finds it free (a burst of these fuses on chained, as in place)
            out = blank.new()
            copier().copy(tensor, out, known.models[0].nbytes)
        debug.count_all(HIT_COPY)
        # the prepared call moved to the new copy: the design keeps its plan for the
        # shape and renews only what names the array (Prepared.move_to), so the call
        # plans nothing; an error still lands on ``out``, the op's array
        prepared = known.prepared
        if prepared is None:   # the name's first repeat (repeats.Copy)
            prepared = known.prepared = Prepared([out], job.design)
        prepared.move_to(out)
        repeat = job.again_direct   # as again()'s
        if repeat is None or not repeat(prepared, known.models, 0, job.pending):
            job.again(prepared, known.models, 0)
        return out

    def allreduce_copy(self, name, tensor, average=False):
        """A new NDArray of ``tensor``'s values summed over the ranks (the mean with
        ``average``), ``tensor`` left as it was: :meth:`again_copy`, else a copy (one engine
        op for a legacy NDArray, engine.arrays.copy_of) allreduced in place and remembered
        for the next call (``sources`` of :meth:`allreduce`)."""
        found = self.again_copy(name, tensor, average) if average.__class__ is bool else None
        if found is not None:
            return found
        copy = copy_of(tensor) if tensor.__class__ is mx.nd.NDArray else tensor.copy()
        return self.allreduce([name], [copy], average, again=False, sources=[tensor])[0]

    def _repeat(self, name, tensor, average, factor, scale=None):
        """The record (repeats.Again) of ``name``'s last call where this one is on its very array,
        reduced and scaled alike, for Job.again; else None (counted: fastpath)."""
        known = self._again.get(name)
        if (known is None or known.tensor is not tensor or known.handle is not tensor.handle
                or known.models[0].average != average or known.models[0].factor != factor
                or known.models[0].scale != scale
                or known.prepared.owner is not self._job.design):
            debug.count('fastpath', 'miss')
            return None
        debug.count_all(HIT)
        return known

    def check(self, names, tensors):
        """Raise what :meth:`allreduce` would reject ``tensors`` for before it submits
        anything (a closed store, an error waiting to be raised, a tensor that is no
        NDArray): for a caller that changes them first (horovod.ops: a prescale op)."""
        self._job.begin()
        check_arrays(names, tensors)

    def dtypes(self, names, tensors):
        """Each tensor's numpy dtype: known without asking MXNet where the tensor is the
        very array of its name's last allreduce."""
        found = []
        for name, tensor in zip(names, tensors):
            known = self._again.get(name)
            try:
                found.append(known.dtype if known is not None and known.tensor is tensor
                             and known.handle is tensor.handle else np.dtype(tensor.dtype))
            except (AttributeError, TypeError):
                check_arrays(names, tensors)
                raise
        return found

    def _in_place_request(self, name, tensor, meta, average, factor=1.0, scale=None):
        """The allreduce of ``tensor`` itself; ``meta``: its (shape, dtype, place)."""
        shape, dtype, place = meta
        known = self._signed.get(name)
        if known is not None and known[:3] == meta:
            debug.count('named', 'hit')
            sig = known[3]
        else:
            debug.count('named', 'miss')
            sig = signature('allreduce', name, dtype, shape, 0, place)
            if len(self._signed) >= _SIGNED_LIMIT:
                self._signed.clear()
            self._signed[name] = meta + (sig,)
        count = 1
        for d in shape:
            count *= d
        return Collective('allreduce', name, dtype, shape, array=tensor, average=average,
                          nbytes=count * dtype.itemsize, sig=factor_sig(sig, factor, scale),
                          place=place, in_place=True, factor=factor, scale=scale)

    def run(self, fn, name='custom'):
        """``fn(mpi_comm)`` in collective order on the store's communicator; its result. On
        an elastic world ``mpi_comm`` is a comm.host.PolledComm of it."""
        self._job.begin()
        if self._polled_us is not None:
            fn = _polled(fn, self._polled_us)
        req = Collective('custom', '__%s__' % name, fn=fn)
        self._job.submit([req], 0)
        req.wait()
        self._job.errors.raise_pending()
        return req.result

    def barrier(self):
        """Every rank waits here once its collectives pushed so far finished."""
        self._job.begin()
        self._job.wait()
        req = Collective('barrier', '__barrier__')
        self._job.submit([req], 0)
        req.wait()
        self._job.errors.raise_pending()


def _polled(fn, poll_us):
    return lambda mpi: fn(PolledComm(mpi, poll_us))

"""MXNet's per-key loops held to one submit: gluon.Trainer's _allreduce_grads and Module's
_update_params_on_kvstore push one key a call, in order, and read no weights until the loop
ends, so their collectives (and with a batching optimizer their updates) may wait for the
loop's last key, which is read from the loop's frame before it is pushed.

:class:`LoopGate` holds the collectives and sends them as one submit. :class:`HeldLoop`,
the base of optimizer.StoreOptimizer, decides which calls wait (``before``), delivers them
(``after``), and from a loop's third step runs each of its held calls in one function
(``again``), which shares its start (:meth:`HeldLoop._ready`) with the full path's, so that
the two cannot differ in what they flush or where they aim a key.
"""
import sys

import mxnet as mx
from mxnet import gluon
from mxnet import model as mx_model

from .. import debug
from ..engine.records import Prepared
from .namecache import Batch

__all__ = ['HeldLoop', 'LoopGate', 'LOOP_GROUP_BYTES', 'TRAINER_LOOP']

# Bytes of a loop's held collectives that go out together, without waiting for the loop's
# last key: a large model's first groups are reduced while backward still makes the others
# (DistributedTrainer's group_bytes, whose default this is).
LOOP_GROUP_BYTES = 4 << 20
# the debug counters of a held loop's repeated call (HeldLoop.again), made once and counted
# in one (debug.count_all), as Exchange.again's
_HITS = (('call_cache', 'hit'), ('fastpath', 'hit'), ('loop', 'again'))
_HELD = (('loop', 'held'),)


# For each of MXNet's loops, the last key the loop pushes this time, read from its frame.
def _trainer_last(frame):
    params = frame.f_locals['self']._params
    for i in range(len(params) - 1, -1, -1):
        if params[i].grad_req != 'null':
            return i
    return None


def _module_last(frame):
    local = frame.f_locals
    grads = local['grad_arrays']
    for i in range(len(grads) - 1, -1, -1):
        if grads[i][0] is not None:
            return local['param_names'][i]
    return None


TRAINER_LOOP = gluon.Trainer._allreduce_grads.__code__
_LOOPS = {TRAINER_LOOP: _trainer_last,
          mx_model._update_params_on_kvstore.__code__: _module_last}
_DEPTH = 6   # frames from HeldLoop.before up to the store's caller, and a margin


def _loop(held=None, held_last=None):
    """(the code of the MXNet loop this push or pushpull comes from, the last key it pushes
    this time, the loop's frame), or (None, None, None) for any other caller (each of its
    calls is then delivered at once, and its arrays are used as today). ``held``: the frame
    of the loop whose calls the gate holds, whose last key is ``held_last`` (not read
    again: the loop's locals are made into a dict at each read)."""
    frame = sys._getframe(2)
    for _ in range(_DEPTH):
        if frame is None:
            break
        if frame is held:
            return frame.f_code, held_last, frame
        last = _LOOPS.get(frame.f_code)
        if last is not None:
            return frame.f_code, last(frame), frame
        frame = frame.f_back
    return None, None, None


def _batches(updater):
    """Whether the updater's optimizer runs a list of keys as MXNet's multi-tensor updates,
    aggregate_num keys an operator: MXNet's SGD, whose multi-tensor update is elementwise,
    so that a batch gives the very same weights as one key at a time. Any other optimizer
    gains nothing from a batch, or could round otherwise."""
    optimizer = updater.optimizer
    return isinstance(optimizer, mx.optimizer.SGD) and optimizer.aggregate_num > 1


class LoopGate:
    """The store's job as the exchange sees it. Where the store's optimizer runs MXNet's own
    per-key loop (HeldLoop.before says so by ``holding``), each call's collectives are held,
    and go out with the loop's last key's, or once LOOP_GROUP_BYTES are held, as one submit:
    one engine op and one agreement for the loop instead of one per key, as a
    DistributedTrainer's grouped pushpull. The loop's last key is known before it is pushed
    (read from the loop's frame), so nothing waits on a time: a key pushed alone, or by any
    other caller, goes at once. Any other submit sends what is held first, in call order.
    The engine's record of the combined op is prepared once for the very same arrays
    (engine.records.Prepared), as a repeated call's. Everything else is the job's."""

    def __init__(self, job):
        self._job = job
        self.holding = False   # set by HeldLoop.before for a call whose requests wait
        self.reqs = []         # the held requests, in call order
        self._priority = None  # the highest priority of the held calls
        self._nbytes = 0
        self._prepared = None
        # gluon.Trainer's loop without the store's optimizer (hold_loop): its frame while
        # it holds calls, and its last key
        self.loop = self._last = None

    def hold_loop(self, frame, key, reqs, priority):
        """A pushpull of gluon.Trainer's loop with update_on_kvstore=False (``frame``),
        prepared and in place (Exchange.again): held, or with the loop's last key (read from
        its frame once a run of the loop) sent with every call held, as one submit."""
        if self.loop is not frame:
            self.loop, self._last = frame, _trainer_last(frame)
        last = key == self._last
        self.holding = not last
        try:
            self.submit(reqs, priority)
        finally:
            self.holding = False
        if last:
            self.loop = None

    def __getattr__(self, name):   # design, wait, begin, errors, ...: the job's
        return getattr(self._job, name)

    def submit(self, reqs, priority):
        held = self.reqs
        if held or self.holding:   # a loop's key a call: no builtin call, one counter
            held.extend(reqs)
            if self._priority is None or priority > self._priority:
                self._priority = priority
            nbytes = self._nbytes
            for req in reqs:
                nbytes += req.nbytes
            self._nbytes = nbytes
            if self.holding and nbytes < LOOP_GROUP_BYTES:
                debug.count_all(_HELD)
                return
            self.send()
            return
        self._job.submit(reqs, priority)

    def send(self):
        """Submit the held requests as one call."""
        reqs, priority = self.reqs, self._priority
        if not reqs:
            return
        self.reqs, self._priority, self._nbytes = [], None, 0
        debug.count('loop', 'submit')
        arrays = [req.array for req in reqs if req.array is not None]
        prepared = self._prepared
        design = self._job.design
        if (prepared is None or prepared.owner is not design
                or len(prepared.arrays) != len(arrays)
                or not all(a is b for a, b in zip(arrays, prepared.arrays))):
            prepared = self._prepared = Prepared(arrays, design)
        batch = Batch(reqs)
        batch.prepared = prepared
        self._job.submit(batch, priority)


class HeldLoop:
    """A push's or pushpull's part in MXNet's loops: :meth:`before` and :meth:`after` the
    exchange's collectives, and :meth:`again` for a held loop's prepared call.

    The base of optimizer.StoreOptimizer, which gives ``clip`` (the clipped step under way,
    or None: no call of a clipped step is held), :meth:`_checked` (its checks of a call's
    keys, last in :meth:`before`) and :meth:`_settle` (a call's delivery where its update is
    not batched)."""

    clip = None   # the subclass's

    def __init__(self, keys, config, job, gate=None):
        self._keys, self._config, self._job = keys, config, job
        # what _direct reads of the config (whose values never change), read once: each
        # option is a __getattr__ call, and again asks at every key of a loop
        self._in_place = bool(config.zero_copy and not config.shard_optimizer)
        self.gate = gate if gate is not None else LoopGate(job)
        self._last = None      # before() -> after(): the batching loop's last key, or None
        self._frame = None     # the loop whose collectives the gate holds
        self._frame_last = None   # and its last key
        self._batching = (None, 0, False)   # (optimizer, its aggregate_num, _batches)
        self._waiting = []     # (plans, priority) of calls whose collectives are held

    def release(self, flush=True):
        """Send what the gate holds and deliver the calls that waited for it (a store call
        other than the loop's next; the loop's end sends them itself). ``flush``: deliver
        held updates too."""
        self.gate.holding = False
        self._frame = self._frame_last = self.gate.loop = None
        self.gate.send()
        self._after_sent()
        if flush:
            self._keys.flush()

    def idle(self):
        """Whether nothing is held: no collective by the gate, no call's delivery, no
        update (what :meth:`release` would send or deliver)."""
        return not (self.gate.reqs or self._waiting or self._keys.holding())

    def _after_sent(self):
        waiting, self._waiting = self._waiting, []
        for plans, priority in waiting:
            self._after(plans, priority)

    def _direct(self, code):
        """Whether a call from ``code`` (an MXNet loop's, or None) updates its keys where
        they are: gluon.Trainer's loop, zero_copy, no shard (keys.KeyTable.aim)."""
        return code is TRAINER_LOOP and self._in_place

    def _ready(self, plans, direct):
        """The start of a call that :meth:`before` and :meth:`again` share: held updates
        delivered first, unless this call joins their batch, then each whole key aimed."""
        keys = self._keys
        if self._last is None or keys.holds(plans):
            keys.flush()
        if keys.updater is not None:
            for plan in plans:
                if plan.share is None:
                    keys.aim(plan, direct)

    def before(self, plans):
        """Decide whether the call's updates wait for a batch: only in MXNet's own loops
        (_LOOPS), with no clipped step and no shard, and never past the loop's last key.
        Held updates of other calls are delivered first, before this call stages its
        gradients, unless this call joins their batch; then :meth:`_checked`.

        In gluon.Trainer's loop (and only there: a user's own call never has its input
        written) a single-device key is reduced in the gradient itself and updated in the
        Trainer's weights, which become the store's value (keys.KeyTable.aim): two engine
        copies a key less, and param.grad() then holds the sum over the ranks, as with
        update_on_kvstore=False."""
        updater = self._keys.updater
        code = last = frame = None
        if (updater is not None and self.clip is None
                and all(plan.share is None for plan in plans)):
            code, last, frame = _loop(self._frame, self._frame_last)
        gate = self.gate
        gate.holding = False
        if (gate.reqs or self._waiting) and frame is not self._frame:
            self.release(flush=False)   # not the held loop's next call: the held go first
        if last is not None:
            optimizer, batching = updater.optimizer, self._batching
            if batching[0] is not optimizer or batching[1] != optimizer.aggregate_num:
                batching = self._batching = (optimizer, optimizer.aggregate_num,
                                             _batches(updater))
            self._last = last if batching[2] else None
        else:
            self._last = None
        if last is not None and not any(plan.state.key == last for plan in plans):
            gate.holding, self._frame, self._frame_last = True, frame, last
        else:
            self._frame = self._frame_last = None
        self._ready(plans, self._direct(code))
        self._checked(plans)

    def again(self, entry, priority):
        """A prepared call (namecache.Replay ``entry``, its codec, priority and design
        unchanged: Exchange.again) of the loop whose earlier call :meth:`before` held, other
        than its last key, in one function: as :meth:`before` and the full path
        (Exchange.replay) would run it, its requests (renewed from the entry's models) held
        by the gate, its delivery waiting for the loop's last key. True once done; False,
        with nothing changed, for any other call (another caller, the loop's last key, a
        clipped step, a sharded or held key, a key aimed elsewhere): the full path."""
        frame = self._frame
        if (frame is None or sys._getframe(3) is not frame or self.clip is not None
                or entry.sharded is not False):
            return False
        plans, keys, last = entry.plans, self._keys, self._frame_last
        for plan in plans:
            if plan.state.key == last:
                return False
        if keys.holds(plans):
            return False
        direct = self._direct(frame.f_code)
        for plan, work in zip(plans, entry.works):
            if keys.aimed(plan, direct) is not work:   # before anything changes
                return False
        errors = self._job.errors
        if errors.waiting:   # one test when nothing failed, not a call
            errors.raise_pending()
        debug.count_all(_HITS)
        self._ready(plans, direct)
        reqs = [model.renewed() for model in entry.models]
        for plan in entry.staged:
            plan.stage()
        gate = self.gate
        gate.holding = True
        gate.submit(reqs, priority)
        self.after(plans, priority)
        return True

    def after(self, plans, priority):
        """After a call's collectives were submitted (or, in a loop, held by the gate):
        once the gate holds none, deliver the calls that waited, in call order, then this
        one (:meth:`_after`)."""
        self.gate.holding = False
        if self.gate.reqs:
            self._waiting.append((plans, priority))
            return
        if self._waiting:
            self._after_sent()
        self._after(plans, priority)

    def _after(self, plans, priority):
        """Hold a batching loop's call, and deliver the batch at the loop's last key; any
        other call is :meth:`_settle`'s."""
        if self._last is None:
            self._settle(plans, priority)
            return
        self._keys.hold(plans)
        if any(plan.state.key == self._last for plan in plans):
            self._keys.flush()

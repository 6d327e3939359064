"""Property: random sequences of valid and invalid store calls, checked against numpy.

usage: kv_property.py DESIGN [MAX_EXAMPLES]

Hypothesis draws programs: six keys (even slots int keys, odd slots str keys) with
a shape and dtype each, then calls (pushpull, push, pull, init, broadcast from
rank 0, broadcast from any root) in the forms the contract allows: one key or a list,
a value or a per-device list (cpu(0), cpu(1)), out None / the value itself / separate arrays,
int priorities. Some calls carry exactly one fault: a bad priority or root, a
shape or dtype other than the key's first use, an out unlike its value, mixed key
kinds, a value list of the wrong length, a bool or non-NDArray value, devices
that differ, a pull or push of a key with no value, an init of an initialised key.

A faulty call must raise on the calling rank with a message that names the
problem, and leave no trace: its arrays keep their contents, and a model of the
store (each key's shape and dtype once a valid call fixed them, and its stored
value) still holds. Every other result is compared with numpy: each rank adds a
deterministic function of (rank, call, key, device, element). Each example ends
with kv.wait(), a pull of every stored value, a pull of every key without one
(which must raise), and one pushpull of every key: a key the model has not seen
is pushed with a shape no valid call used, so one that a rejected call
registered after all raises there.

Every rank must draw the same programs, or they would issue different
collectives: derandomize=True, no database, no shrinking (a shrink on one rank
only would desynchronise the ranks), and each example starts by comparing a
hash of its program across ranks. One store serves the whole run; keys are
fresh per example. KV_PROPERTY_ZERO_DIM=1 also draws 0-d arrays, which the
store cannot stage yet (mx.nd.zeros(()) fails in MXNet 1.9's legacy mode).
"""
import collections
import itertools
import os
import random
import sys
import zlib

import mxnet as mx
import numpy as np
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import mpi_kvstore
from mpi_kvstore.store.contract import SUPPORTED_DTYPES

from common import RANK, SIZE, WORLD, design_arg, done

DESIGN = design_arg()
# 150 examples take 7-30 s per design at 2 ranks on the 2-core VM (3-8 calls each).
MAX_EXAMPLES = int(sys.argv[2]) if len(sys.argv) > 2 else 150
ZERO_DIM = os.environ.get('KV_PROPERTY_ZERO_DIM') == '1'

SLOTS = 6                           # keys per example: even slots int, odd slots str
MIN_CALLS, MAX_CALLS = 3, 8         # calls per example
FUSION = 32 << 10                   # small keys fuse; LARGE travels alone
LARGE = ((64, 256), 'float32')      # 64 KB
PROBE = ((7,), 'float64')           # no drawn shape has a 7: a leaked registration shows
CTXS = (mx.cpu(0), mx.cpu(1))       # different devices to the store, on the CPU wheel
DTYPES = tuple(d.name for d in SUPPORTED_DTYPES)
GOOD_PRIORITIES = (0, 0, 1, -1, 3, -7, -(1 << 20))
BAD_PRIORITIES = ('high', 1.5, True, None, 1 << 31)
BAD_ROOTS = (SIZE, -1, True, 1.0, None)
NOT_ARRAYS = ('numpy', 'floats', 'text', 'empty', 'none')
# Faults each call can carry; pull's arrays are its outs.
FAULTS = {
    'pushpull': ('priority', 'shape', 'out', 'mixed', 'count', 'bool', 'not_array', 'devices'),
    'push': ('priority', 'shape', 'mixed', 'count', 'bool', 'not_array', 'devices',
             'no_value'),
    'pull': ('priority', 'shape', 'mixed', 'count', 'bool', 'not_array', 'devices',
             'no_value'),
    'init': ('shape', 'mixed', 'count', 'bool', 'not_array', 'devices', 'init_again'),
    'broadcast': ('priority', 'shape', 'out', 'mixed', 'count', 'bool', 'not_array',
                  'devices'),
    'broadcast_root': ('priority', 'shape', 'out', 'mixed', 'count', 'bool', 'not_array',
                       'devices', 'root'),
}
# How often each is drawn, relatively: pushpull is the call that training makes; a
# shape fault is the one that could leave a half-registered key list behind.
CALL_WEIGHTS = {'pushpull': 3, 'push': 1, 'pull': 1, 'init': 1, 'broadcast': 1,
                'broadcast_root': 1}
FAULT_WEIGHTS = {'priority': 1, 'shape': 2, 'out': 1, 'mixed': 1, 'count': 1, 'bool': 1,
                 'not_array': 1, 'devices': 1, 'no_value': 1, 'init_again': 1, 'root': 1}
OUT_MODES = {'pushpull': (None, 'same', 'new'), 'broadcast': (None, 'same', 'new'),
             'broadcast_root': (None, 'same', 'new')}

STATS = collections.Counter()
EXAMPLES = itertools.count()


# -- programs: pure data, the same on every rank ---------------------------------------------
def specs():
    dims = st.lists(st.integers(1, 5), min_size=0 if ZERO_DIM else 1, max_size=3)
    return st.tuples(dims.map(tuple), st.sampled_from(DTYPES))


@st.composite
def slot_spec(draw):
    # 5, not a bound of the range: Hypothesis favours those.
    return LARGE if draw(st.integers(0, 9)) == 5 else draw(specs())


class Meta:
    """What a program knows of the store while it is drawn: registered and valued slots."""

    def __init__(self):
        self.registered, self.valued = set(), set()

    def candidates(self, call):
        """Slots a valid call of this kind may name."""
        if call in ('pull', 'push'):   # push needs init or broadcast first, as in MXNet
            return self.valued
        if call == 'init':
            return set(range(SLOTS)) - self.valued
        return set(range(SLOTS))

    def fault_slots(self, call, fault):
        """Slots the faulty key may be, so that the fault is the call's only problem."""
        if fault == 'no_value':
            return set(range(SLOTS)) - self.valued
        if fault == 'init_again':
            return set(self.valued)
        if fault == 'shape':
            return self.registered & self.candidates(call)
        return self.candidates(call)

    def callers(self, fault):
        """Calls that can carry this fault (None: be valid) now."""
        return [c for c in CALL_WEIGHTS if (fault is None or fault in FAULTS[c])
                and self.fault_slots(c, fault)]

    def apply(self, op):
        if op['fault'] is not None or op['call'] == 'pull':
            return
        self.registered.update(op['slots'])
        if op['call'] != 'pushpull':
            self.valued.update(op['slots'])


@st.composite
def operation(draw, meta, slots, rnd):
    if rnd.random() < 0.35:  # a faulty call: every (call, fault) pair about as often
        pairs = [(c, f) for f in FAULT_WEIGHTS for c in meta.callers(f)]
        call, fault = rnd.choices(pairs, [FAULT_WEIGHTS[f] for _, f in pairs])[0]
    else:
        fault = None
        calls = meta.callers(None)
        call = rnd.choices(calls, [CALL_WEIGHTS[c] for c in calls])[0]
    first = rnd.choice(sorted(meta.fault_slots(call, fault)))
    others = sorted(s for s in meta.candidates(call) if s % 2 == first % 2 and s != first)
    if fault in ('shape', 'init_again') and rnd.random() < 0.5:
        # Keys the call would register first, if it changed anything before it raised.
        others = [s for s in others if s not in meta.registered]
    rest = draw(st.lists(st.sampled_from(others), unique=True, max_size=2)) if others else []
    pos = draw(st.integers(0, len(rest)))
    keys = rest[:pos] + [first] + rest[pos:]
    n = len(keys)
    ndev = draw(st.lists(st.integers(1, 2), min_size=n, max_size=n))
    if fault == 'devices':
        ndev[pos] = 2
    op = {'call': call, 'slots': keys, 'fault': fault, 'fpos': pos, 'ndev': ndev,
          'bare': draw(st.lists(st.booleans(), min_size=n, max_size=n)),
          'single': n == 1 and fault not in ('mixed', 'count') and draw(st.booleans()),
          'out': None, 'priority': draw(st.sampled_from(GOOD_PRIORITIES)), 'root': 0,
          'detail': None, 'sync': draw(st.integers(0, 3)) == 0}
    if call in OUT_MODES:
        op['out'] = 'new' if fault == 'out' else draw(st.sampled_from(OUT_MODES[call]))
        if op['out'] == 'new':
            op['out'] = draw(st.lists(st.tuples(st.integers(1, 2), st.booleans()),
                                      min_size=n, max_size=n))
    if call == 'broadcast_root':
        op['root'] = draw(st.integers(0, SIZE - 1))
    op['detail'] = draw(fault_detail(fault, slots[first], n))
    return op


def fault_detail(fault, spec, nkeys):
    """What exactly is wrong: a bad value, another spec, where the odd key goes."""
    if fault == 'priority':
        return st.sampled_from(BAD_PRIORITIES)
    if fault == 'root':
        return st.sampled_from(BAD_ROOTS)
    if fault in ('shape', 'out', 'devices'):
        return specs().filter(lambda other: other != spec)
    if fault == 'not_array':
        return st.sampled_from(NOT_ARRAYS)
    if fault == 'count':
        return st.sampled_from((1, -1) if nkeys > 1 else (1,))
    if fault == 'mixed':
        return st.integers(0, nkeys)
    return st.none()


@st.composite
def programs(draw):
    slots = [draw(slot_spec()) for _ in range(SLOTS)]
    # Which call and which fault come from this generator, evenly: Hypothesis favours
    # the first options of sampled_from, and repeats its integers between examples.
    seed = draw(st.lists(st.integers(0, 255), min_size=8, max_size=8))
    rnd = random.Random(repr((seed, slots)))
    meta, ops = Meta(), []
    for _ in range(draw(st.integers(MIN_CALLS, MAX_CALLS))):
        op = draw(operation(meta, slots, rnd))
        meta.apply(op)
        ops.append(op)
    return {'slots': slots, 'ops': ops}


# -- values: what each rank adds, and what the sums must be ----------------------------------
def contribution(rank, call, pos, dev, spec):
    """This rank's array: small numbers, so that sums stay exact in every dtype."""
    shape, dtype = spec
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    k = (np.arange(n) * 3 + rank * 7 + call * 11 + pos * 5 + dev * 13) % 9
    vals = k if dtype.kind == 'u' else k - 4
    if dtype.kind == 'f':
        vals = vals * 0.5
    return vals.astype(dtype).reshape(shape)


def total(call, pos, ndev, spec):
    """Sum over ranks and devices, computed wide and cast back."""
    acc = sum(contribution(r, call, pos, d, spec).astype(np.float64)
              for r in range(SIZE) for d in range(ndev))
    return np.asarray(acc).astype(spec[1])


def key_name(example_index, slot):
    if slot % 2 == 0:
        return 100000 + 16 * example_index + slot
    return 'x%d_s%d' % (example_index, slot)


def nd(content, ctx):
    if content.dtype == np.bool_:
        return mx.nd.zeros(content.shape, ctx=ctx, dtype='bool')
    return mx.nd.array(content, ctx=ctx, dtype=content.dtype)


class Checks:
    """Arrays and what they must hold once the example's work has finished."""

    def __init__(self):
        self._items = []

    def add(self, array, expected, what):
        self._items.append((array, np.array(expected, copy=True), what))

    def verify(self):
        for array, expected, what in self._items:
            same(array.asnumpy(), expected, what)
        self._items = []


def same(got, expected, what):
    if got.dtype != expected.dtype or got.shape != expected.shape:
        raise AssertionError('rank %d: %s: got %s %s, expected %s %s' % (
            RANK, what, got.dtype, got.shape, expected.dtype, expected.shape))
    if expected.dtype.kind == 'f':
        tol = 1e-2 if expected.dtype == np.float16 else 1e-6
        ok = np.allclose(got, expected, rtol=tol, atol=tol)
    else:
        ok = np.array_equal(got, expected)
    if not ok:
        raise AssertionError('rank %d: %s: got %s, expected %s' % (
            RANK, what, got.ravel()[:8], expected.ravel()[:8]))


# -- one call ----------------------------------------------------------------------------------
class Call:
    """One drawn operation made concrete: its keys, arrays and expected outcome."""

    def __init__(self, example_index, index, op, slots):
        self.op, self.index = op, index
        self.ex = example_index
        self.keys = [key_name(example_index, s) for s in op['slots']]
        self.specs = [slots[s] for s in op['slots']]
        self.built = []          # (array, content) of every NDArray made, to check later
        self.values = [self._devices(pos, self._value_spec(pos), op['ndev'][pos], 0)
                       for pos in range(len(self.keys))]
        self.outs = None
        if isinstance(op['out'], list):
            self.outs = [self._devices(pos, self._out_spec(pos), n, 5)
                         for pos, (n, _) in enumerate(op['out'])]

    def _faulty(self, pos, fault):
        return self.op['fault'] == fault and self.op['fpos'] == pos

    def _value_spec(self, pos):
        if self._faulty(pos, 'bool'):
            return (self.specs[pos][0], 'bool')
        if self._faulty(pos, 'shape'):
            return self.op['detail']
        return self.specs[pos]

    def _out_spec(self, pos):
        return self.op['detail'] if self._faulty(pos, 'out') else self._value_spec(pos)

    def _devices(self, pos, spec, ndev, salt):
        """One array per device; pull's (salt 5 for outs) start as junk to overwrite."""
        if self.op['call'] == 'pull':
            salt = 5
        arrays = []
        for dev in range(ndev):
            own = self.op['detail'] if dev == 1 and self._faulty(pos, 'devices') else spec
            content = (np.zeros(own[0], dtype=bool) if own[1] == 'bool'
                       else contribution(RANK, self.index, pos, dev + salt, own))
            arr = nd(content, CTXS[dev])
            self.built.append((arr, content))
            arrays.append(arr)
        return arrays

    # -- the call as the user writes it
    def _form(self, per_key, bare_flags):
        entries = [arrs[0] if bare and len(arrs) == 1 else arrs
                   for arrs, bare in zip(per_key, bare_flags)]
        return entries[0] if self.op['single'] else entries

    def arguments(self):
        op = self.op
        key = self.keys[0] if op['single'] else list(self.keys)
        value = self._form(self.values, op['bare'])
        out = None
        if op['out'] == 'same':
            out = value
        elif self.outs is not None:
            out = self._form(self.outs, [bare for _, bare in op['out']])
        fault, detail, pos = op['fault'], op['detail'], op['fpos']
        if fault == 'mixed':
            other = key_name(self.ex, 15 - self.op['slots'][0] % 2)  # the other kind
            key.insert(detail, other)
            value.insert(detail, nd(np.zeros((2,), np.float32), CTXS[0]))
        elif fault == 'count':
            value = value + [value[-1]] if detail > 0 else value[:-1]
        elif fault == 'not_array':
            bad = {'numpy': np.zeros(self.specs[pos][0]), 'floats': [1.0, 2.0], 'text': 'oops',
                   'empty': [], 'none': None}[detail]
            if op['single']:
                value = bad
            else:
                value[pos] = bad
        return key, value, out

    def invoke(self, kv):
        key, value, out = self.arguments()
        op = self.op
        prio = op['detail'] if op['fault'] == 'priority' else op['priority']
        call = op['call']
        if call == 'pushpull':
            kv.pushpull(key, value, out=out, priority=prio)
        elif call == 'push':
            kv.push(key, value, priority=prio)
        elif call == 'pull':
            kv.pull(key, out=value, priority=prio)
        elif call == 'init':
            kv.init(key, value)
        elif call == 'broadcast':
            kv.broadcast(key, value, out, priority=prio)
        else:
            root = op['detail'] if op['fault'] == 'root' else op['root']
            kv.broadcast(key, value, out=out, root=root, priority=prio)

    # -- expectations
    def expected_error(self):
        """(exception type, words its message must hold) for a faulty call."""
        op = self.op
        fault, detail = op['fault'], op['detail']
        key = repr(self.keys[op['fpos']])
        if fault == 'priority':
            if isinstance(detail, int) and not isinstance(detail, bool):
                return ValueError, ['priority must lie between']
            return TypeError, ['priority must be an int, not %r' % (detail,)]
        shape = self.specs[op['fpos']][0]
        arg = 'out' if op['call'] == 'pull' else 'value'  # the argument at fault
        return {
            'shape': (ValueError, ['%s for key %s' % (arg, key),
                                   'the key has shape %s' % (shape,)]),
            'out': (ValueError, ['out for key ' + key, 'but value has shape']),
            'mixed': (TypeError, ['keys must be all int or all str']),
            'count': (ValueError, [arg + ' must be a list with one entry per key']),
            'bool': (TypeError, ['%s for key %s' % (arg, key), 'dtype bool']),
            'not_array': (TypeError, ['%s for key %s' % (arg, key), 'NDArray']),
            'no_value': (mpi_kvstore.UnknownKeyError, [key, 'has no value']),
            'init_again': (ValueError, [key, 'already initialised']),
            'root': (ValueError, ['root must be a rank']),
            'devices': (ValueError, ['%s arrays for key %s' % (arg, key),
                                     'differ between devices']),
        }[fault]

    def run(self, kv, model, checks):
        STATS[self.op['call'], self.op['fault']] += 1
        if self.op['fault'] is None:
            self.invoke(kv)
            self.expect(model, checks)
        else:
            self.rejected(kv)
            for arr, content in self.built:  # no trace: nothing was written
                checks.add(arr, content, '%s of a rejected call' % self.describe())
        if self.op['sync']:
            checks.verify()

    def rejected(self, kv):
        exc_type, words = self.expected_error()
        try:
            self.invoke(kv)
        except exc_type as err:
            missing = [w for w in words if w not in str(err)]
            if missing:
                raise AssertionError('rank %d: %s raised %s without %s in its message: %s'
                                     % (RANK, self.describe(), type(err).__name__, missing,
                                        err)) from err
            return
        except Exception as err:
            raise AssertionError('rank %d: %s should raise %s, raised %r'
                                 % (RANK, self.describe(), exc_type.__name__, err)) from err
        raise AssertionError('rank %d: %s should raise %s, but was accepted'
                             % (RANK, self.describe(), exc_type.__name__))

    def describe(self):
        op = self.op
        return 'call %d of example %d (%s of %s, fault %s %r)' % (
            self.index, self.ex, op['call'], self.keys, op['fault'], op['detail'])

    def expect(self, model, checks):
        """A valid call: what its arrays and the store hold after it."""
        call, what = self.op['call'], self.describe()
        for pos, slot in enumerate(self.op['slots']):
            values, outs = self.values[pos], self.outs[pos] if self.outs else None
            if call == 'pull':
                for arr in values:
                    checks.add(arr, model.value[slot], what)
                continue
            model.registered.add(slot)
            if call in ('pushpull', 'push'):
                result = total(self.index, pos, len(values), self.specs[pos])
            else:
                root = self.op['root'] if call == 'broadcast_root' else 0
                result = contribution(root, self.index, pos, 0, self.specs[pos])
            if call != 'pushpull':
                model.value[slot] = result
            self._targets(pos, values, outs, result, checks, what)

    def _targets(self, pos, values, outs, result, checks, what):
        call, mode = self.op['call'], self.op['out']
        in_place = mode == 'same' or (
            mode is None and call in ('pushpull', 'broadcast', 'broadcast_root'))
        for dev, arr in enumerate(values):
            mine = contribution(RANK, self.index, pos, dev, self.specs[pos])
            checks.add(arr, result if in_place else mine, what)
        for arr in outs or ():
            checks.add(arr, result, what)


class Model:
    """The store as the test believes it to be: registered slots and stored values."""

    def __init__(self):
        self.registered = set()
        self.value = {}


# -- one example -------------------------------------------------------------------------------
def agree(example_index, program):
    digest = zlib.crc32(repr((example_index, program)).encode())
    digests = WORLD.allgather(digest)
    if len(set(digests)) != 1:
        raise AssertionError('rank %d: ranks drew different programs for example %d: %s'
                             % (RANK, example_index, digests))


def final_checks(kv, ex, slots, model, checks):
    """The store holds what the model says, and every key still sums."""
    for kind in (0, 1):
        mine = [s for s in range(SLOTS) if s % 2 == kind]
        valued = [s for s in mine if s in model.value]
        if valued:
            outs = [mx.nd.zeros(slots[s][0], dtype=slots[s][1]) for s in valued]
            kv.pull([key_name(ex, s) for s in valued], out=outs, priority=kind)
            for s, arr in zip(valued, outs):
                checks.add(arr, model.value[s], 'final pull of slot %d' % s)
        for s in mine:
            if s not in model.value:
                try:
                    kv.pull(key_name(ex, s), out=mx.nd.zeros((1,)))
                except mpi_kvstore.UnknownKeyError:
                    continue
                raise AssertionError('rank %d: slot %d of example %d holds a value the '
                                     'model does not know' % (RANK, s, ex))
        specs_ = [slots[s] if s in model.registered else PROBE for s in mine]
        vals = [nd(contribution(RANK, 99, i, 0, sp), CTXS[0]) for i, sp in enumerate(specs_)]
        try:
            kv.pushpull([key_name(ex, s) for s in mine], vals)
        except ValueError as err:  # a rejected call registered a key after all
            raise AssertionError('rank %d: example %d: a key has a shape the model does not '
                                 'know: %s' % (RANK, ex, err)) from err
        for i, (arr, sp) in enumerate(zip(vals, specs_)):
            checks.add(arr, total(99, i, 1, sp), 'final pushpull, key %r'
                       % key_name(ex, mine[i]))
    kv.wait()
    checks.verify()


def explicit(call, slots, fault=None, fpos=0, detail=None, **form):
    """An operation written by hand, in the form the generator draws."""
    op = {'call': call, 'slots': slots, 'fault': fault, 'fpos': fpos, 'ndev': [1] * len(slots),
          'bare': [True] * len(slots), 'single': False, 'out': None, 'priority': 0, 'root': 0,
          'detail': detail, 'sync': False}
    op.update(form)
    return op


# Every call that registers keys, rejected at its last key: the fresh keys before it
# must stay unregistered (the final pushpull gives them another shape) and unvalued.
ATOMIC = {'slots': [((3,), 'float32'), ((2, 2), 'int32'), ((4,), 'float32'), LARGE,
                    ((1,), 'uint8'), ((5, 1), 'float16')],
          'ops': [explicit('pushpull', [0]),
                  explicit('pushpull', [2, 0], 'shape', 1, ((3,), 'float64'), ndev=[2, 1]),
                  explicit('push', [4], 'no_value', 0, single=True),
                  explicit('broadcast', [2, 4, 0], 'shape', 2, ((3, 1), 'float32'),
                           out=[(1, True)] * 3),
                  explicit('broadcast_root', [4, 0], 'shape', 1, ((3,), 'int32'), root=1),
                  explicit('init', [2, 0], 'shape', 1, ((3,), 'float16'), sync=True),
                  explicit('init', [3, 1], ndev=[1, 2]),
                  explicit('init', [5, 3], 'init_again', 1),
                  explicit('pull', [1, 5], 'no_value', 1),
                  explicit('pull', [3], 'priority', 0, 'high', single=True)]}

# Every fault at least once, whatever the draws: calls on registered and valued keys.
EVERY_FAULT = {'slots': ATOMIC['slots'],
               'ops': [explicit('init', [0, 2]),
                       explicit('push', [0, 2], ndev=[2, 1]),
                       explicit('init', [1, 3]),
                       explicit('pushpull', [0], 'priority', 0, 1.5, single=True),
                       explicit('broadcast_root', [2], 'root', 0, SIZE),
                       explicit('pull', [0, 2], 'count', 0, 1),
                       explicit('init', [4], 'mixed', 0, 0),
                       explicit('push', [4], 'not_array', 0, 'none', single=True),
                       explicit('pull', [1, 3], 'devices', 0, ((2,), 'float32'), ndev=[2, 1]),
                       explicit('broadcast', [0], 'bool', out=[(2, False)]),
                       explicit('broadcast_root', [2, 0], 'out', 1, ((5,), 'int8'), root=1,
                                out=[(1, False), (2, True)]),
                       explicit('pushpull', [2, 0], out='same', priority=-3, sync=True),
                       explicit('pull', [2, 0], ndev=[2, 1])]}


@settings(derandomize=True, database=None, deadline=None, max_examples=MAX_EXAMPLES,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
          print_blob=False)
@given(programs())
@example(ATOMIC)
@example(EVERY_FAULT)
def test_calls(program):
    ex = next(EXAMPLES)
    agree(ex, program)
    model, checks = Model(), Checks()
    for index, op in enumerate(program['ops']):
        Call(ex, index, op, program['slots']).run(kv_store(), model, checks)
    kv_store().wait()
    checks.verify()
    final_checks(kv_store(), ex, program['slots'], model, checks)


_STORE = []


def kv_store():
    if not _STORE:
        _STORE.append(mpi_kvstore.create('dist_mpi', design=DESIGN, fusion_threshold=FUSION))
    return _STORE[0]


def report():
    calls = sum(STATS.values())
    rejected = sum(n for (_, fault), n in STATS.items() if fault is not None)
    faults = collections.Counter()
    for (_, fault), n in STATS.items():
        faults[fault or 'valid'] += n
    examples = next(EXAMPLES)
    if RANK == 0:
        print('kv_property[%s]: %d examples, %d calls, %d rejected; %s' % (
            DESIGN, examples, calls, rejected,
            ', '.join('%s %d' % kv for kv in sorted(faults.items()))), flush=True)
    return {'examples': examples, 'calls': calls, 'rejected': rejected, 'by_fault': faults}


def main():
    kv_store()
    test_calls()
    stats = report()
    kv_store().close()
    done('kv_property[%s]' % DESIGN, **stats)


main()

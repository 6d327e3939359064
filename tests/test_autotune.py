"""designs/autotune.py without MPI: the search on known cost surfaces, the knobs a user set,
the ranks' agreement from their own timings, the bound it settles within, the tune table it
writes, and one store (1 rank) that tunes itself while its sums stay exact.

Several ranks are simulated by one Tuner each, agreed as the MAX-allreduce agrees them
(numpy's max of their summaries), with rank 0's decision handed to every rank.
"""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpi_kvstore import config as cfg
from mpi_kvstore.comm import tuning
from mpi_kvstore.designs import autotune
from mpi_kvstore.designs.autotune import GRID, KNOBS, CoordinateSearch, Tuner

START = {'partition_bytes': 4 << 20, 'credit_bytes': 8 << 20, 'fusion_threshold': 1 << 20,
         'progress_sleep_us': 200.0}


def surface(draw_costs):
    """A separable cost: base + one term per knob, keyed by the knob's value."""
    return lambda values: 0.1 + sum(draw_costs[k][values[k]] for k in KNOBS)


def run_search(search, cost):
    measured = 0
    while (values := search.proposal()) is not None:
        search.record(cost(values))
        measured += 1
    return measured


@st.composite
def separable_costs(draw):
    """Per knob, a distinct cost for each grid value and the start (ties would let either
    value win)."""
    costs = {}
    for knob in KNOBS:
        values = sorted(set(GRID[knob]) | {START[knob]})
        terms = draw(st.lists(st.integers(0, 1000), min_size=len(values), max_size=len(values),
                              unique=True))
        costs[knob] = {v: t * 1e-4 for v, t in zip(values, terms)}
    return costs


@settings(max_examples=200, deadline=None)
@given(costs=separable_costs(), free=st.sets(st.sampled_from(KNOBS)))
def test_search_finds_the_minimum_of_a_separable_surface_in_one_pass(costs, free):
    search = CoordinateSearch(START, free, margin=0.0, joint=())   # one knob at a time
    measured = run_search(search, surface(costs))
    expected = {k: (min(costs[k], key=costs[k].get) if k in free else START[k]) for k in KNOBS}
    assert search.best == expected
    assert search.best_cost == pytest.approx(surface(costs)(expected))
    # one pass, plus the pair measured again for each knob that moved
    moved = sum(1 for k in free if expected[k] != START[k])
    assert measured == 1 + sum(len(set(GRID[k]) - {START[k]}) for k in free) + 2 * moved
    assert measured <= autotune.samples(START, free, joint=())


def test_search_keeps_the_start_unless_another_value_is_clearly_faster():
    # 2% faster is noise under a 3% margin; 10% faster wins.
    def cost(values):
        return {0: 0.98, 1 << 20: 1.0, 4 << 20: 1.0}[values['partition_bytes']] * (
            0.9 if values['credit_bytes'] == 0 else 1.0)
    search = CoordinateSearch(START, ('partition_bytes', 'credit_bytes'), joint=())
    run_search(search, cost)
    assert search.best['partition_bytes'] == START['partition_bytes']
    assert search.best['credit_bytes'] == 0


def test_a_lucky_sample_is_measured_again_and_does_not_move_the_knob():
    # partition_bytes=0's first sample is 10% fast by chance (its true cost is the start's);
    # measured again right after the values in use, it is not faster, so the start stays.
    # credit_bytes=0 is truly 10% faster: it wins both times and is kept.
    seen = {'partition': 0}

    def cost(values):
        if values['partition_bytes'] == 0:
            seen['partition'] += 1
            return 0.9 if seen['partition'] == 1 else 1.0
        return 0.9 if values['credit_bytes'] == 0 else 1.0
    search = CoordinateSearch(START, ('partition_bytes', 'credit_bytes'), joint=())
    measured = run_search(search, cost)
    assert seen['partition'] == 2
    assert search.best == dict(START, credit_bytes=0)
    assert search.best_cost == pytest.approx(0.9)
    # start, 2 partition values, its pair again, 3 credit values, its pair again
    assert measured == 1 + 2 + 2 + 3 + 2 == autotune.samples(
        START, ('partition_bytes', 'credit_bytes'), joint=())
    rechecks = [values for values, _ in search.trials[3:5]]
    assert rechecks == [START, dict(START, partition_bytes=0)]


def test_a_drift_between_the_pairs_is_judged_on_the_second_pair():
    # The machine slows by 20% after the knob's values were measured: the values in use,
    # measured again, cost 1.2, the candidate 1.1: still 8% faster, so it is kept, and the
    # best cost is the candidate's latest figure, not the first, faster one.
    costs = iter([1.0, 0.9, 1.0, 1.2, 1.1])   # start, 0, 1M, start again, 0 again

    def cost(values):
        return next(costs)
    search = CoordinateSearch(START, ('partition_bytes',))
    run_search(search, cost)
    assert search.best == dict(START, partition_bytes=0)
    assert search.best_cost == pytest.approx(1.1)


def test_a_lead_inside_the_margin_on_one_sample_is_measured_again_and_kept():
    # FIFO is truly 5-7% faster, but its first sample is only 2% faster: short of the margin
    # on its own. Faster at all, it is measured again back to back with the start, wins
    # that pair by 7%, and both pairs together by 4.5%: kept. (One sample that had to pass
    # the margin alone missed it: 4 hosts at 10 Gbit/s, two jobs.)
    costs = iter([1.0, 0.98, 1.0, 0.93])    # start, FIFO, start again, FIFO again
    free = ('partition_bytes', 'credit_bytes')
    search = CoordinateSearch(START, free, grid={'partition_bytes': (4 << 20,),
                                                 'credit_bytes': (8 << 20,)})
    run_search(search, lambda values: next(costs))
    assert search.best == dict(START, partition_bytes=0, credit_bytes=0)
    assert search.best_cost == pytest.approx(0.93)


@pytest.mark.parametrize('first, again, second, kept', [
    (0.98, 1.0, 0.98, False),   # 2% faster both times: inside the margin, summed too
    (0.90, 1.0, 0.99, False),   # a lucky first sample, then 1%: the pair needs half the margin
    (0.90, 1.0, 1.00, False),   # a lucky first sample, then level
    (0.99, 1.0, 0.94, True),    # 1%, then 6%: both pairs faster, 3.5% over the two
    (0.99, 1.0, 0.975, False),  # 1%, then 2.5%: each pair faster, 1.75% over the two
])
def test_a_value_is_kept_where_both_pairs_are_faster_and_their_sum_by_the_margin(
        first, again, second, kept):
    costs = iter([1.0, first, again, second])
    search = CoordinateSearch(START, ('partition_bytes',), grid={'partition_bytes': (0,)})
    run_search(search, lambda values: next(costs))
    assert search.best == (dict(START, partition_bytes=0) if kept else START)
    assert search.best_cost == pytest.approx(second if kept else again)
    assert [values['partition_bytes'] for values, _ in search.trials] == [4 << 20, 0, 4 << 20, 0]


def test_fifo_is_tried_as_one_setting_where_neither_knob_alone_gains():
    # No pieces and no credit together are 10% faster; either alone is 5% slower, so a
    # search one knob at a time keeps the start. FIFO is tried first, as one candidate,
    # and the knobs' values it already set are not measured again.
    def cost(values):
        off = (values['partition_bytes'] == 0) + (values['credit_bytes'] == 0)
        return {0: 1.0, 1: 1.05, 2: 0.9}[off]
    free = ('partition_bytes', 'credit_bytes')
    alone = CoordinateSearch(START, free, joint=())
    run_search(alone, cost)
    assert alone.best == START
    search = CoordinateSearch(START, free)
    measured = run_search(search, cost)
    fifo = dict(START, partition_bytes=0, credit_bytes=0)
    assert search.best == fifo and search.best_cost == pytest.approx(0.9)
    tried = [values for values, _ in search.trials]
    assert tried[:4] == [START, fifo, START, fifo]          # the start, FIFO, the pair again
    assert tried[4:].count(fifo) == 0 and len(tried) == measured
    assert measured == 4 + 1 + 2 <= autotune.samples(START, free)   # 1M pieces; 2M, 32M credit
    # a user who set either knob gets no FIFO candidate: it would change what they set
    assert autotune.candidates(START, ('partition_bytes',))[0][0] == 'partition_bytes'
    assert [name for name, _ in autotune.candidates(START, KNOBS)] == ['fifo', *KNOBS]
    assert autotune.candidates(fifo, free) == [('partition_bytes', [{'partition_bytes': 1 << 20},
                                                                    {'partition_bytes': 4 << 20}]),
                                               ('credit_bytes', [{'credit_bytes': 2 << 20},
                                                                 {'credit_bytes': 8 << 20},
                                                                 {'credit_bytes': 32 << 20}])]


@settings(max_examples=100, deadline=None)
@given(given_by=st.dictionaries(st.sampled_from(KNOBS), st.sampled_from(['argument', 'env'])),
       seed=st.integers(0, 2**32 - 1))
def test_a_value_the_user_set_is_never_proposed_otherwise(given_by, seed):
    explicit = {k: START[k] for k, how in given_by.items() if how == 'argument'}
    environ = {'MPI_KVSTORE_' + k.upper(): str(START[k]) for k, how in given_by.items()
               if how == 'env'}
    config = cfg.Config(environ=environ, autotune=True, **explicit).replace(
        origin='auto: 2 hosts', **{k: START[k] for k in KNOBS if k not in given_by})
    assert set(autotune.free_knobs(config)) == set(KNOBS) - set(given_by)
    tuner = Tuner(config, 0, 1)
    rng = np.random.default_rng(seed)
    while (values := tuner.search.proposal()) is not None:
        for knob in given_by:
            assert values[knob] == START[knob]
        tuner.search.record(rng.uniform(0.05, 0.2))
    assert all(tuner.search.best[k] == START[k] for k in given_by)


def config_of(steps=3, environ=None, **explicit):
    """A resolved config (as topology.resolve leaves it) with autotune on."""
    config = cfg.Config(environ=environ or {}, autotune=True, autotune_steps=steps, **explicit)
    auto = {k: START[k] for k in KNOBS if getattr(config, k) == 'auto'}
    return config.replace(origin='auto: 2 hosts', **auto) if auto else config


def agreed_round(tuners):
    """One check of the timings, as Tuner.round runs it on every rank: the MAX of every
    rank's summary, rank 0's decision, every rank's switch. -> what each rank applies."""
    agreed = np.max([t.summary() for t in tuners], axis=0)
    if -agreed[1] < tuners[0].steps:
        return None
    choice = tuners[0].decide(agreed[0])
    return [t.switch(choice) for t in tuners]


@settings(max_examples=60, deadline=None)
@given(ranks=st.integers(2, 4), seed=st.integers(0, 2**32 - 1))
def test_ranks_of_different_timings_switch_alike_to_what_the_slowest_rank_gives(ranks, seed):
    """Each rank measures its own steps (a rank-dependent cost plus noise); every rank applies
    the same values at the same check, and the settled choice is what a search fed the
    slowest rank's median (numpy, independently) chooses."""
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0.5, 2.0, size=(ranks, len(KNOBS)))
    tuners = [Tuner(config_of(), r, ranks) for r in range(ranks)]
    reference = CoordinateSearch(START, KNOBS)

    def step(rank, values):
        terms = [weights[rank, i] * np.log2(2.0 + values[k]) for i, k in enumerate(KNOBS)]
        return 1e-3 * (1.0 + sum(terms)) * rng.uniform(1.0, 1.01)

    clocks = np.zeros(ranks)
    for _ in range(tuners[0].bound):
        for r, tuner in enumerate(tuners):
            clocks[r] += step(r, tuner.current)
            tuner.tick(clocks[r])
        slowest = max(t.summary()[0] for t in tuners)
        applied = agreed_round(tuners)
        if applied is not None:
            assert all(a == applied[0] for a in applied)
            reference.record(slowest)
        assert all(t.current == tuners[0].current for t in tuners)
        if not tuners[0].active:
            break
    assert not any(t.active for t in tuners)
    assert tuners[0].current == reference.best
    assert [t.switches for t in tuners] == [tuners[0].switches] * ranks


def test_ranks_whose_users_set_different_knobs_follow_rank_0s_search(tmp_path):
    """Equal values may come from an argument on one rank and a default on another (the
    ranks agree on values, not origins): every rank still checks at the same rounds, and
    rank 0, whose user set every knob, settles them all at the first sample, changing
    nothing and writing nothing."""
    path = tmp_path / 'table.json'
    path.write_text(json.dumps(tuning.Table([1024], ['mpi'], 2).to_json()))
    table = tuning.Table.from_json(json.loads(path.read_text()))
    everything = {k: (str(v) if k == 'progress_sleep_us' else cfg.format_bytes(v))
                  for k, v in START.items()}
    tuners = [Tuner(config_of(tune_table=str(path), **everything), 0, 2, table),
              Tuner(config_of(tune_table=str(path)), 1, 2, table)]
    assert (tuners[0].free, tuners[1].free) == ((), KNOBS)
    assert all(t.active for t in tuners)
    checks, clock = 0, 0.0
    while tuners[0].active:
        clock += 1e-3
        for t in tuners:
            t.tick(clock)
        checks += agreed_round(tuners) is not None
        assert tuners[0].active == tuners[1].active
    assert checks == 1
    assert all(t.current == START and t.switches == [] for t in tuners)
    assert 'schedule' not in json.loads(path.read_text())


def test_it_settles_within_its_stated_bound_on_one_rank_and_picks_the_cheapest():
    steps = 4
    tuner = Tuner(config_of(steps), 0, 1)
    best = {'partition_bytes': 0, 'credit_bytes': 2 << 20, 'fusion_threshold': 256 << 10,
            'progress_sleep_us': 50.0}

    def cost(values):   # 10% a knob off its best value
        return 1e-3 * (1 + 0.1 * sum(values[k] != best[k] for k in KNOBS))

    clock, ran = 0.0, 0
    while tuner.active:
        clock += cost(tuner.current)
        tuner.tick(clock)
        ran += 1
        for _ in range(autotune.CHECK_EVERY):   # a step runs at least one round
            tuner.round(comm=None)
        assert ran <= tuner.bound
    assert tuner.current == best
    assert tuner.bound == autotune.settle_bound(steps, autotune.samples(START, KNOBS))
    # settled: a gradient turning ready is no longer timed (a job trains on for days)
    req = type('Req', (), {'kind': 'allreduce', 'key': 'k'})()
    before = tuner._steps_seen
    tuner.ready([req])
    assert tuner._steps_seen == before and tuner._intervals == []


def test_the_choice_goes_into_the_tune_tables_schedule_and_the_next_run_starts_there(tmp_path):
    path = tmp_path / 'table.json'
    table = tuning.Table([1024, 1 << 20], ['mpi', 'rsag'], 2,
                         schedule={'credit_bytes': 4 << 20})
    payload = table.to_json(measured={'mpi': [1.0]})
    path.write_text(json.dumps(payload))
    tuned = {'partition_bytes': 1 << 20, 'fusion_threshold': 4 << 20, 'progress_sleep_us': 50.0}
    assert autotune.save(str(path), tuned)
    written = json.loads(path.read_text())
    assert written['schedule'] == dict(tuned, credit_bytes=4 << 20)
    assert written['allreduce'] == payload['allreduce']
    assert written['measured_ms'] == {'mpi': [1.0]}
    again = tuning.Table.from_json(written)
    assert again.schedule['fusion_threshold'] == 4 << 20
    started = autotune.start_config(cfg.Config(environ={}), again)
    assert (started.fusion_threshold, started.origin('fusion_threshold')) == (
        4 << 20, 'tune table')
    kept = autotune.start_config(cfg.Config(environ={}, fusion_threshold='64K'), again)
    assert (kept.fusion_threshold, kept.origin('fusion_threshold')) == (64 << 10, 'argument')
    assert not autotune.save(str(tmp_path / 'absent.json'), tuned)


def test_the_options_default_to_auto_and_are_checked():
    assert cfg.Config(environ={}).autotune == 'auto'
    assert cfg.Config(environ={'MPI_KVSTORE_AUTOTUNE': 'on'}).autotune is True
    assert cfg.Config(environ={'MPI_KVSTORE_AUTOTUNE': 'off'}).autotune is False
    with pytest.raises(cfg.ConfigError, match='MPI_KVSTORE_AUTOTUNE'):
        cfg.Config(environ={'MPI_KVSTORE_AUTOTUNE': 'sometimes'})
    with pytest.raises(cfg.ConfigError, match='MPI_KVSTORE_AUTOTUNE_STEPS'):
        cfg.Config(environ={'MPI_KVSTORE_AUTOTUNE_STEPS': '0'})
    assert 'autotune' in cfg.AGREED and 'autotune_steps' in cfg.AGREED


@pytest.mark.parametrize('design', ['funneled', 'concurrent'])
def test_a_store_tunes_itself_while_its_sums_stay_exact(design):
    """One rank, the whole path: steps pushed through the store, switches between rounds
    (pieces, credit, fusion, polling all change), every pushpull's result exact."""
    import mxnet as mx

    import mpi_kvstore
    kv = mpi_kvstore.create('dist_mpi', design=design, autotune=True, autotune_steps=1,
                            partition_bytes='1M', credit_bytes=0, fusion_threshold='1M',
                            progress_sleep_us=0)
    state = kv.autotune_state
    assert state.free == () and state.active   # every knob set here: nothing to search
    assert state.values == {k: getattr(kv.config, k) for k in KNOBS}
    kv.close()
    kv = mpi_kvstore.create('dist_mpi', design=design, autotune=True, autotune_steps=1)
    start = kv.config
    shapes = {'w0': (300000,), 'w1': (1000,), 'w2': (70000,)}
    step = 0
    while kv.autotune_state.active and step < kv.autotune_state.bound:
        for i, (key, shape) in enumerate(shapes.items()):
            value = np.arange(np.prod(shape), dtype=np.float32) % 97 + step + i
            out = mx.nd.zeros(shape)
            kv.pushpull(key, mx.nd.array(value), out=out, priority=-i)
            assert np.array_equal(out.asnumpy(), value), (key, step, kv.autotune_state)
        step += 1
    state = kv.autotune_state
    assert not state.active, 'not settled within %d steps' % state.bound
    assert state.switches, 'it never switched'
    assert 0 < state.steps <= step
    # the store's options are the values in use; the state is a copy the search leaves alone
    assert {k: getattr(kv.config, k) for k in KNOBS} == state.values
    assert kv.config is not start and kv.config.origin(next(iter(state.switches[-1][1]))) == \
        'autotune'
    state.values.clear()
    assert kv.autotune_state.values == {k: getattr(kv.config, k) for k in KNOBS}
    assert kv._job.design._queue.partition_bytes == kv.config.partition_bytes   # the cutter too
    assert kv._job.design._queue.credit_bytes == kv.config.credit_bytes   # read from the knobs
    kv.close()


def test_the_step_is_paced_by_the_gradients_not_by_the_pushes():
    """A loop that does not wait between steps pushes them all at once; the tuner's step is
    the time between the first key's gradients turning ready, so it is the compute's."""
    import time

    import mxnet as mx

    import mpi_kvstore
    kv = mpi_kvstore.create('dist_mpi', design='funneled', autotune=True, autotune_steps=50)
    tuner = kv._job.design.tuner
    big = mx.nd.ones((900, 900))
    kv.pushpull('g', mx.nd.dot(big, big))                # the first key; a warm store
    mx.nd.waitall()
    kv.wait()
    tuner._skip, tuner._last, tuner._intervals = 0, None, []
    pushes, grad = [], big
    for _ in range(6):
        # computed by the engine, later: from the last step's sum, as a step's gradient
        # waits for the last update
        grad = mx.nd.dot(big, grad) / 900
        pushes.append(time.perf_counter())
        kv.pushpull('g', grad)
    mx.nd.waitall()
    kv.wait()
    # Every figure comes from this one window, so a busy machine slows them together: the
    # engine's 6 steps of compute take most of it, the loop's 6 pushes a sliver.
    engine = time.perf_counter() - pushes[0]
    steps = tuner._intervals
    kv.close()
    assert np.array_equal(grad.asnumpy(), np.ones((900, 900), np.float32))
    pushed = pushes[-1] - pushes[0]
    assert len(steps) == 5, steps
    assert pushed < engine / 4, (pushed, engine)       # the loop ran ahead of the engine
    # the 5 intervals between 6 gradients turning ready: 5 of the 6 steps' compute
    assert sum(steps) > engine / 2, (steps, pushed, engine)


def test_ranks_switch_at_one_round_to_one_choice_with_exact_sums(tmp_path, mpi_available):
    """scenarios/kv_autotune.py at 2 ranks, both negotiated designs in one job."""
    from mpi_harness import run_mpi
    out = run_mpi(2, 'kv_autotune.py', str(tmp_path / 'table.json'), 'funneled', 'concurrent',
                  timeout=120)
    for design in ('funneled', 'concurrent'):
        assert 'kv_autotune[%s]: OK at 2 ranks' % design in out, out[-3000:]
    assert out.count('autotune settled') == 2, out[-3000:]     # once a store, rank 0 alone


def test_doctor_shows_whether_it_tunes_what_and_the_tables_tuned_schedule(tmp_path, monkeypatch):
    from mpi_kvstore.cli import doctor
    path = tmp_path / 'table.json'
    path.write_text(json.dumps(tuning.Table([1024], ['mpi'], 1, schedule={
        'partition_bytes': 1 << 20, 'fusion_threshold': 4 << 20}).to_json()))
    for name in ('AUTOTUNE', 'CREDIT_BYTES', 'TUNE_TABLE'):
        monkeypatch.delenv('MPI_KVSTORE_' + name, raising=False)
    assert 'autotune:         off (auto: 1 host;' in '\n'.join(doctor.report())
    monkeypatch.setenv('MPI_KVSTORE_AUTOTUNE', '1')
    monkeypatch.setenv('MPI_KVSTORE_CREDIT_BYTES', '2M')
    monkeypatch.setenv('MPI_KVSTORE_TUNE_TABLE', str(path))
    report = '\n'.join(doctor.report())
    assert ('autotune:         on (environment variable MPI_KVSTORE_AUTOTUNE), 10 steps a '
            'sample, searching partition_bytes, fusion_threshold, progress_sleep_us (the rest '
            'set by the user); the choice goes into %s' % path) in report, report
    assert '  schedule:       partition_bytes=1M, fusion_threshold=4M\n' in report, report

"""One agreed configuration per store (mpi_kvstore/comm/consensus.py, topology.agree): ranks given
different options raise ConfigError together at creation, naming every rank's value."""
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpi_kvstore import config as cfg
from mpi_kvstore.comm import consensus, topology
from mpi_kvstore.errors import ConfigError

from mpi_harness import MPIRunError, parametrize_sizes, result, run_mpi

# Seconds ranks given different options take to raise together: about a second, 20 times
# less than this on a busy machine, and 4 times less than the job timeout a hang would meet.
REFUSED_WITHIN_S = 30


class FakeComm:
    """The ranks of one job inside one process: rank ``me`` of ``everyone``'s settings.
    Allreduce(MIN) and allgather see every rank's contribution, as MPI's would."""

    def __init__(self, everyone, me):
        self.everyone, self.me = everyone, me

    def Get_size(self):
        return len(self.everyone)

    def Allreduce(self, _in_place, buf, op=None):
        msgs = []
        for settings_of_rank in self.everyone:
            msg = np.zeros_like(buf)
            for i, s in enumerate(settings_of_rank):
                msg[i] = consensus.digest('%s=%s' % (s.name, s.key)) + 1
                msg[consensus.SLOTS + i] = -msg[i]
            msgs.append(msg)
        buf[:] = np.minimum.reduce(msgs)

    def allgather(self, _mine):
        return [[(s.name, s.shown, s.origin) for s in row] for row in self.everyone]


def _settings(values):
    return [consensus.Setting(name, repr(v), repr(v), 'argument') for name, v in values]


def _outcome(everyone, me=0):
    try:
        consensus.check(FakeComm(everyone, me), everyone[me])
    except ConfigError as err:
        return str(err)
    return None


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 5), st.data())
def test_check_names_exactly_the_settings_that_differ(nranks, data):
    names = ['design', 'fusion_threshold', 'compression', 'window']
    base = [data.draw(st.integers(0, 3)) for _ in names]
    everyone = []
    for _ in range(nranks):
        values = list(base)
        for i in range(len(names)):
            if data.draw(st.booleans()) and data.draw(st.booleans()):
                values[i] = data.draw(st.integers(0, 3))
        everyone.append(_settings(zip(names, values)))
    differing = {n for i, n in enumerate(names) if len({row[i].key for row in everyone}) > 1}
    for me in range(nranks):   # every rank gets the same answer
        message = _outcome(everyone, me)
        if not differing:
            assert message is None
            continue
        named = set(re.findall(r'(\w+): ', message.split(' disagree on ', 1)[1]))
        assert named == differing, message
        for n in differing:   # every rank's value of each, exactly once
            i = names.index(n)
            part = message.split(n + ': ', 1)[1].split(';')[0].split('. Every')[0]
            assert _ranks_by_value(part) == {rank: row[i].shown
                                             for rank, row in enumerate(everyone)}, part


def _ranks_by_value(part):
    """'1 on ranks 0-2, 4 (argument), 3 on rank 3 (argument)' -> {rank: '1' or '3'}."""
    found = {}
    for shown, ranks in re.findall(r'(\S+) on ranks? ([0-9, -]+?) \(argument\)', part):
        for run in ranks.split(', '):
            lo, _, hi = run.partition('-')
            for rank in range(int(lo), int(hi or lo) + 1):
                assert rank not in found, part
                found[rank] = shown
    return found


def test_rank_ranges_fold_runs():
    assert consensus.rank_ranges([3]) == 'rank 3'
    assert consensus.rank_ranges([2, 0]) == 'ranks 0, 2'
    assert consensus.rank_ranges([0, 1, 2, 3, 7, 9, 10]) == 'ranks 0-3, 7, 9-10'


def test_gate_names_an_invalid_rank_alone():
    valid = topology.settings(cfg.Config(environ={}), '1.0')
    invalid = topology.settings(None, '1.0', ConfigError("invalid environment variable "
                                                               "MPI_KVSTORE_DESIGN='ring'"))
    comm = FakeComm([valid, invalid], 0)
    with pytest.raises(ConfigError) as err:
        consensus.check(comm, valid, gates=('version', 'options'))
    message = str(err.value)
    assert 'options: valid on rank 0' in message and "'ring'" in message
    assert 'design' not in message.split('ring')[1]


def test_versions_that_differ_are_named_whatever_else_differs():
    old = topology.settings(cfg.Config(environ={}), '0.1.0')
    new = topology.settings(cfg.Config(environ={'MPI_KVSTORE_DESIGN': 'chained'}),
                            '0.2.0')
    with pytest.raises(ConfigError, match=r'version: 0\.1\.0 on rank 0 \(installed package\), '
                                          r'0\.2\.0 on rank 1') as err:
        consensus.check(FakeComm([old, new], 1), new, gates=('version', 'options'))
    assert 'design' not in str(err.value)


def test_every_agreed_option_is_compared_and_the_others_are_not():
    config = cfg.Config(environ={})
    names = [s.name for s in topology.settings(config, 'v')]
    assert names == ['version', 'options'] + list(cfg.AGREED)
    for may_differ in ('timeline', 'stall_warning', 'stall_abort', 'poll_us', 'cuda_aware',
                       'name_cache_capacity'):
        assert may_differ not in names
    for must in ('design', 'fusion_threshold', 'partition_bytes', 'credit_bytes', 'window',
                 'compression', 'hierarchical', 'shard_optimizer', 'inline_max_bytes',
                 'tune_table', 'average', 'progress_sleep_us'):
        assert must in names


def test_options_table_marks_what_must_agree():
    table = cfg.options_table()
    assert '| across ranks |' in table.splitlines()[0]
    assert re.search(r'\| `design` .*\| must agree \|', table)
    assert re.search(r'\| `timeline` .*\| may differ \|', table)


def test_origin_of_each_option():
    config = cfg.Config(environ={'MPI_KVSTORE_FUSION_THRESHOLD': '2M'}, design='chained')
    assert config.origin('design') == 'argument'
    assert config.origin('fusion_threshold') == 'environment variable MPI_KVSTORE_FUSION_THRESHOLD'
    assert config.origin('window') == 'default'
    resolved = config.replace(origin='auto: 2 hosts', partition_bytes=4 << 20)
    assert resolved.origin('partition_bytes') == 'auto: 2 hosts'
    assert resolved.origin('design') == 'argument'


# 3 ranks: the values are grouped by rank (2 ranks are the training script's case below).
@parametrize_sizes((3,))
def test_ranks_given_different_options_are_refused_together(nprocs, mpi_available):
    out = run_mpi(nprocs, 'kv_agree.py', timeout=240)
    assert 'kv_agree[' in out and 'OK at %d ranks' % nprocs in out
    name = 'kv_agree[auto, design, horovod, invalid, may_differ, several, subcomm, tune_table]'
    ranks = result(out, name)['ranks']
    # rank r pushes arange(7) + r into a store that was made: numpy's sum, over 7 values
    total = nprocs * 21 + 7 * nprocs * (nprocs - 1) / 2
    for rank in ranks:
        # each case's disagreeing options: a ConfigError on every rank, none left waiting
        assert rank['raised'] == ['ConfigError'] * 8, rank['raised']
        for store in ('after_design', 'may_differ', 'table_b.json'):
            assert rank['checked'][store] == [[7], total], (store, rank['checked'])


@parametrize_sizes((2, 3))
def test_a_training_script_given_different_designs_ends_in_words(nprocs, mpi_available):
    """The issue's case: without the agreement it hung until killed (120 s)."""
    with pytest.raises(MPIRunError) as failed:
        run_mpi(nprocs, 'kv_agree_train.py', timeout=120, module_launch=False)
    out = failed.value.output
    others = 'rank 1' if nprocs == 2 else 'ranks 1-%d' % (nprocs - 1)
    line = ("ConfigError: ranks of a store disagree on design: 'funneled' on rank 0 (argument), "
            "'chained' on %s (environment variable MPI_KVSTORE_DESIGN)" % others)
    assert out.count(line) == nprocs, out[-3000:]
    took = [float(t) for t in re.findall(r'store creation ended after ([0-9.]+) s', out)]
    # 1.25 s on a loaded 2-core machine; a hang runs into the 120 s timeout instead
    assert len(took) == nprocs and max(took) < REFUSED_WITHIN_S, took
    assert 'trained 5 steps' not in out

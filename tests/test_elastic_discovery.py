"""The elastic launcher's hosts, in one process: a discovery script's output (Horovod's
``host:slots`` format), blacklisting, the order of hosts, and the notices' signatures."""
import json

import pytest

from mpi_kvstore.launch import discovery, rendezvous

pytestmark = pytest.mark.unit


def test_parse_reads_host_slots_lines_in_order_with_the_default_slots():
    text = 'b:2\n\n  a  \nc:0\nb:3\n'
    assert discovery.parse(text, default_slots=4) == [('a', 4), ('c', 0), ('b', 3)]


@pytest.mark.parametrize('line', ['a:x', 'a:-1', ':2', 'a b:1'])
def test_parse_refuses_a_line_that_is_not_host_slots(line):
    with pytest.raises(ValueError, match='is not host:slots'):
        discovery.parse(line)


def test_run_script_runs_a_shell_command_and_names_a_failure(tmp_path):
    hosts = tmp_path / 'hosts'
    hosts.write_text('h1:2\nh2\n')
    assert discovery.run_script('cat %s' % hosts, default_slots=3) == [('h1', 2), ('h2', 3)]
    with pytest.raises(RuntimeError, match='exited with status 3: oops'):
        discovery.run_script('echo oops >&2; exit 3')


def test_wanted_keeps_the_oldest_hosts_first_and_skips_blacklisted_ones():
    found = [[('a', 2), ('b', 1)]]
    hosts = discovery.Hosts(lambda: found[0])
    assert hosts.update() is True
    assert hosts.wanted(set()) == [('a', 0), ('a', 1), ('b', 0)]
    found[0] = [('c', 1), ('b', 1), ('a', 2)]   # a new host listed first still comes last
    assert hosts.update() is True and hosts.update() is False
    assert hosts.wanted(set(), limit=4) == [('a', 0), ('a', 1), ('b', 0), ('c', 0)]
    hosts.blacklist('a')
    # a blacklisted host keeps the slots whose workers still run, and gets no new one
    assert hosts.wanted({('a', 1)}) == [('a', 1), ('b', 0), ('c', 0)]
    found[0] = [('b', 1)]
    hosts.update()
    assert hosts.wanted({('a', 1), ('b', 0)}) == [('b', 0)]


def test_local_names():
    assert discovery.is_local('localhost') and discovery.is_local('127.0.0.3')
    assert not discovery.is_local('node-17.example')


def test_a_notice_signed_with_another_secret_is_refused(tmp_path, caplog):
    secret = rendezvous.new_secret()
    rendezvous.announce_hosts(str(tmp_path), secret, 3, [0, 2, 5], False, 1.5)
    path = rendezvous.hosts_path(str(tmp_path))
    found = rendezvous.read_signed(path, secret)
    assert found == {'number': 3, 'members': '0,2,5', 'removed_only': 0, 'time': '1.500000'}
    assert rendezvous.read_signed(path, rendezvous.new_secret()) is None
    body = json.loads(open(path).read())
    body['members'] = '0,2,5,9'   # a member slipped in: the signature no longer matches
    open(path, 'w').write(json.dumps(body))
    assert rendezvous.read_signed(path, secret) is None
    assert "signature does not match the job's secret" in caplog.text


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_without_a_cooldown_a_failed_host_is_out_for_good():
    clock = Clock()
    hosts = discovery.Hosts(lambda: [('a', 1), ('b', 1)], clock=clock)
    hosts.update()
    hosts.blacklist('b')
    clock.now += 10 ** 6
    assert hosts.wanted(set()) == [('a', 0)] and hosts.blacklisted == {'b'}


def test_a_failed_host_comes_back_after_a_cooldown_that_doubles_up_to_the_high_end():
    """Horovod's --blacklist-cooldown-range 5 12: out 5 s after the first failure, 10 after
    the second, 12 (the cap) after the third; back only while the script lists it."""
    clock = Clock()
    found = [[('a', 1), ('b', 2)]]
    hosts = discovery.Hosts(lambda: found[0], cooldown=(5, 12), clock=clock)
    hosts.update()
    everything = [('a', 0), ('b', 0), ('b', 1)]
    for failure, seconds in enumerate([5, 10, 12, 12], 1):
        hosts.blacklist('b')
        hosts.blacklist('b')   # another of its workers in the same failure: counted once
        assert hosts.failures['b'] == failure
        assert hosts.wanted({('b', 1)}) == [('a', 0), ('b', 1)]   # a running worker stays
        clock.now += seconds - 0.01
        assert hosts.wanted(set()) == [('a', 0)] and hosts.blacklisted == {'b'}
        clock.now += 0.02
        assert hosts.wanted(set()) == everything and hosts.blacklisted == set()
    hosts.blacklist('b')
    found[0] = [('a', 1)]   # the script no longer lists b: its cooldown's end adds nothing
    hosts.update()
    clock.now += 13
    assert hosts.wanted(set()) == [('a', 0)] and not hosts.is_blacklisted('b')
    found[0] = [('b', 2), ('a', 1)]   # listed again: back, and in its old place
    hosts.update()
    assert hosts.wanted(set()) == everything


@pytest.mark.parametrize('bad', [(0, 5), (6, 5), (-1, 2)])
def test_a_cooldown_range_must_be_positive_and_ordered(bad):
    with pytest.raises(ValueError, match='0 < low <= high'):
        discovery.Hosts(lambda: [], cooldown=bad)


def test_the_command_line_hands_the_cooldown_range_to_the_driver(monkeypatch, tmp_path):
    from mpi_kvstore.launch import supervisor
    seen = {}

    def run(self):
        seen['cooldown'] = self.hosts.cooldown
        return 0
    monkeypatch.setattr(supervisor.Driver, 'run', run)
    argv = ['--host-discovery-script', 'echo localhost', '--state-dir', str(tmp_path),
            '--launcher', 'mpiexec', '--blacklist-cooldown-range', '2', '30', '--', 'true']
    assert supervisor.main(argv) == 0 and seen['cooldown'] == (2.0, 30.0)
    assert supervisor.main(argv[:6] + ['--', 'true']) == 0 and seen['cooldown'] is None
    with pytest.raises(SystemExit):
        supervisor.main(argv[:7] + ['30', '2', '--', 'true'])

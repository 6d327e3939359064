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

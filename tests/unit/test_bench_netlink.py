"""kvstrata/bench/netlink.py: the shaped veth link of `kvstrata bench pd --link-rate`.
The link test makes two network namespaces (root, iproute2, veth and tbf needed; skipped
otherwise), shapes them at 200mbit and checks the achieved rate, the unshaped paths around
it, and that nothing is left behind. No model server is started (a few seconds in all)."""
from __future__ import annotations

import subprocess

import pytest

from kvstrata.bench import netlink
from kvstrata.bench.netlink import (
    LinkUnavailable,
    NetLink,
    blast,
    parse_rate,
    tbf_params,
)


def test_parse_rate_and_tbf_params():
    assert parse_rate("10gbit") == 10e9
    assert parse_rate("200mbit") == 200e6
    assert parse_rate("1.5Gbit") == 1.5e9
    with pytest.raises(ValueError):
        parse_rate("10G")
    burst, limit = tbf_params(200e6)
    assert burst == 256 << 10 and limit == burst + 250_000  # 10 ms at 25 MB/s
    burst, limit = tbf_params(10e9)
    assert burst == 1_250_000 and limit == burst + 12_500_000  # 1 ms / 10 ms at 1.25 GB/s


def _root_devices() -> str:
    return subprocess.run(["ip", "-br", "link"], capture_output=True, text=True,
                          check=False).stdout


@pytest.fixture
def link():
    reason = netlink.why_unavailable()
    if reason:
        pytest.skip(reason)
    lk = NetLink()
    try:
        lk.up()
    except LinkUnavailable as e:
        pytest.skip(f"network namespaces unavailable here: {e}")
    try:
        yield lk
    finally:
        lk.down()


def test_shaped_link_rate_and_cleanup(link):
    try:
        link.shape("200mbit")
    except LinkUnavailable as e:
        pytest.skip(str(e))
    shaped = blast(link.exec_prefix("p"), link.exec_prefix("d"), link.addr("d"), 1.0)
    assert 0.2 * 0.6 < shaped["gbps"] < 0.2 * 1.3, shaped
    # Unshaped paths: loopback inside P, and the root namespace (router, client) reaching
    # both servers' link addresses over their own links, not over the shaped one.
    lo = blast(link.exec_prefix("p"), link.exec_prefix("p"), "127.0.0.1", 0.3)
    assert lo["gbps"] > 5 * shaped["gbps"], (lo, shaped)
    for side in "pd":
        direct = blast([], link.exec_prefix(side), link.addr(side), 0.3)
        assert direct["gbps"] > 3 * shaped["gbps"], (side, direct, shaped)
    names = dict(link.ns)
    link.down()
    left = netlink.namespaces()
    assert not set(names.values()) & set(left), left
    assert f"kv{link.token}" not in _root_devices()


def test_stale_namespaces_of_dead_runs_are_swept():
    reason = netlink.why_unavailable()
    if reason:
        pytest.skip(reason)
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{netlink.PREFIX}-{dead.pid}-abc123-p"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True,
                      check=False).returncode != 0:
        pytest.skip("cannot create a network namespace here")
    try:
        assert name in netlink.sweep_stale()
        assert name not in netlink.namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def test_link_rate_flag_refuses_typos_and_stops_where_no_link_can_be_made(monkeypatch, capsys):
    """--link-rate is an explicit request: where namespaces cannot be made the bench stops
    with one clear line and exit 2 rather than measure loopback."""
    import argparse

    from kvstrata.bench import pd

    ap = argparse.ArgumentParser()
    pd.add_args(ap)
    assert ap.parse_args(["--link-rate", "10gbit", "25gbit"]).link_rate == ["10gbit", "25gbit"]
    with pytest.raises(SystemExit):
        ap.parse_args(["--link-rate", "10G"])
    capsys.readouterr()
    monkeypatch.setattr(netlink, "why_unavailable", lambda: "creating network namespaces "
                        "needs root")
    with pytest.raises(SystemExit) as exc:
        pd.run_links(ap.parse_args(["--link-rate", "10gbit"]), "/nonexistent")
    assert exc.value.code == 2
    assert "error: --link-rate needs network namespaces, veth and tbf: creating network " \
           "namespaces needs root" in capsys.readouterr().err

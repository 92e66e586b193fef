"""Memory sizes a user writes (``--memory``, ``--devices 1xcpu@40GiB``): bytes only, with a unit
(issue 54, items 5 and 9). "Gb" is gigabits and a bare number has no unit: both are refused,
naming the text and the spellings that work, instead of being read as gigabytes or bytes."""

from __future__ import annotations

import argparse
import importlib

import pytest

from partita.cli.devices import devices_argument
from partita.cli.main import main
from partita.cli.parser import build_parser
from partita.errors import InputError
from partita.units import parse_bytes


@pytest.mark.parametrize(
    "text, num_bytes",
    [
        ("80GiB", 80 * 2**30),
        ("40GB", 40 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 GiB", int(1.5 * 2**30)),
        ("2TB", 2 * 10**12),
        ("4KiB", 4096),
        ("4KB", 4000),
        ("4kB", 4000),
        ("100B", 100),
    ],
)
def test_byte_units_are_read(text, num_bytes):
    assert parse_bytes(text) == num_bytes


@pytest.mark.parametrize("text", ["40Gb", "40gb", "40Mb", "40kb", "40b", "40Gbit", "40gbit", "40Gib"])
def test_bits_are_refused_not_read_as_bytes(text):
    with pytest.raises(InputError, match="bits") as caught:
        parse_bytes(text, "--memory")
    message = str(caught.value)
    assert repr(text) in message and "--memory" in message
    assert "GB / GiB" in message  # the accepted spellings


def test_gigabits_say_what_they_are_worth():
    with pytest.raises(InputError, match=r"40Gb is 5GB; write 5GB, or 40GB if 40 GB was meant"):
        parse_bytes("40Gb")
    with pytest.raises(InputError, match=r"write 40MB if 40 MB was meant"):
        parse_bytes("40mB")  # millibytes, as written


@pytest.mark.parametrize("text", ["40", "0.5", " 40 "])
def test_a_size_needs_a_unit(text):
    number = text.strip()
    with pytest.raises(InputError, match=rf"has no unit: write {number}GiB .* or {number}GB"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["40 gigs", "40mB", "40GIB", "abc", "GiB", "-1GiB"])
def test_other_units_and_texts_are_refused(text):
    with pytest.raises(InputError, match=repr(text)):
        parse_bytes(text)


@pytest.mark.parametrize("memory", ["40Gb", "40"])
def test_device_groups_refuse_bits_and_bare_numbers(memory):
    with pytest.raises(argparse.ArgumentTypeError, match=rf"1xcpu@{memory}.*(bits|no unit)"):
        devices_argument(f"2xcpu,1xcpu@{memory}")
    assert devices_argument("2xcpu,1xcpu@40GiB")[1].memory == "40GiB"


@pytest.mark.parametrize("command", ["plan", "train"])
def test_memory_flag_is_bytes_with_a_unit(command, capsys):
    extra = ["--devices", "2", "--global-batch", "8"] if command == "plan" else []
    args = build_parser().parse_args([command, "mlp", *extra, "--memory", "512MiB"])
    assert args.memory == 512 * 2**20
    for bad, why in (("4Gb", "bits"), ("4", "no unit")):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "mlp", *extra, "--memory", bad])
        assert why in capsys.readouterr().err


def test_plan_refuses_gigabits_before_loading_the_model(monkeypatch, capsys):
    cli = importlib.import_module("partita.cli.main")  # the module (partita.cli.main is also its function)
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("the model was loaded before --devices was refused"))
    with pytest.raises(SystemExit):
        main(["plan", "mlp", "--devices", "2xcpu,1xcpu@40Gb", "--global-batch", "8"])
    err = capsys.readouterr().err
    assert "'Gb' is a unit of bits" in err and "40GB" in err

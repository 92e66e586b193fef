"""What ``help(partita.fit)`` and ``partita.__all__`` tell a user (issue 54, item 11): fit documents
every argument itself, and what it returns and the errors a run raises are public names."""

from __future__ import annotations

import inspect

import partita
import partita.errors
from partita.training import fit as fit_module


def test_fit_documents_every_argument_in_its_own_docstring():
    doc = inspect.getdoc(partita.fit)
    assert "module docstring" not in doc
    for name in inspect.signature(partita.fit).parameters:
        assert f"``{name}``" in doc, f"partita.fit's docstring does not document {name}"


def test_fit_result_and_rendezvous_timeout_are_public():
    assert "FitResult" in partita.__all__ and partita.FitResult is fit_module.FitResult
    assert inspect.signature(partita.fit).return_annotation in ("FitResult", fit_module.FitResult)
    assert "RendezvousTimeoutError" in partita.__all__
    assert partita.RendezvousTimeoutError is partita.errors.RendezvousTimeoutError
    assert issubclass(partita.RendezvousTimeoutError, partita.PartitaError)

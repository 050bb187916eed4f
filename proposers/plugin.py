"""Registers the built-in proposers. Factories are "module:attr" strings, so listing plugins
imports neither numpy-heavy nor torch-heavy proposer code."""

from __future__ import annotations

from specloop.kernel.hookspecs import Register, hookimpl


@hookimpl
def specloop_register_proposers(register: Register) -> None:
    register("ngram", "specloop.proposers.ngram:NgramProposer")
    register("draft_model", "specloop.proposers.draft_model:DraftModelProposer")
    register("mtp", "specloop.proposers.mtp:MTPProposer")
    register("deepseek_mtp", "specloop.proposers.mtp:MTPProposer")  # vLLM's name
    register("eagle", "specloop.proposers.eagle:EagleProposer")
    register("eagle3", "specloop.proposers.eagle:Eagle3Proposer")
    register("medusa", "specloop.proposers.medusa:MedusaProposer")
    register("controlled", "specloop.proposers.controlled:ControlledProposer")


@hookimpl
def specloop_register_speculation_policies(register: Register) -> None:
    register("fixed", "specloop.proposers.policy:FixedPolicy")
    register("adaptive", "specloop.proposers.policy:AdaptivePolicy")

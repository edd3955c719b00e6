"""The report's contract: finding kinds, what each kind's detail holds, suspects, summary.

``commcheck report --json`` prints a :class:`Report`, ``{"findings": [Finding, ...],
"summary": Summary}``, and that JSON is the product's API. This module is its one
definition. The engine builds findings, the collector stores them (each detail as JSON
text), and the report reads them back into these types (:meth:`Finding.from_json`). A field
whose comment says *omitted* is left out of the JSON while it holds its default. Every
other field is always there, ``null`` where the type allows None. Field order is key
order. So a finding that is written and read back prints the same bytes.

Words used below: a *rank* is a global rank. A *side* is the set of ranks whose outputs
hashed alike. A *culprit* is a rank the evidence blames (``Finding.culprits``). JSON object
keys are strings, so maps keyed by rank are keyed by the rank's decimal string (``"3"``).
"""

from __future__ import annotations

from enum import Enum
from typing import Generic, TypeVar

import msgspec

from ..wire.faults import FaultTally


class Kind(str, Enum):
    """What a finding says went wrong. The value is the ``kind`` string in the JSON.

    Three kinds say that a run stalls, once per cause: ``rank_died`` once per rank whose
    process ended without a goodbye (seen by its node's relay, reported at the next hang
    check, without waiting for the hang timeout); ``missing_rank`` once per group and set
    of members that never entered (later collectives of the group they also missed are
    counted into it; none for collectives only dead ranks are missing from, which count
    into their ``rank_died``); ``hang`` once per group whose members all entered a
    collective and not all completed it within the hang timeout (later ones counted
    into it)."""

    VALUE_MISMATCH = "value_mismatch"  # a replicated output differs between ranks
    LINK_CORRUPTION = "link_corruption"  # a chunk arrived unlike what its sender sent
    REDUCTION_ERROR = "reduction_error"  # Σ of the inputs ≠ the output, beyond tolerance
    DESYNC = "desync"  # members disagree on op, dtype, size, reduce op, root or splits
    MISSING_RANK = "missing_rank"  # members waited for others that never entered
    RANK_DIED = "rank_died"  # a rank's process ended without saying goodbye
    HANG = "hang"  # every member entered a collective, not all completed it in time
    NAN_INF = "nan_inf"  # the first collective of a group whose inputs carried NaN/Inf
    GRAD_DIVERGENCE = "grad_divergence"  # gradient probe: a reduced gradient differs
    PARAM_DIVERGENCE = "param_divergence"  # gradient probe: a parameter after the step differs
    STRAGGLER = "straggler"  # a rank (or a node pair's link) makes the others wait

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:  # Python ≥ 3.11 formats a mixin Enum by name
        return format(self.value, spec)


class _Part(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Base of every detail and its parts. Fields with a default are left out of the JSON
    while they hold it. A key the type does not know fails to read instead of vanishing.
    Subclasses repeat ``kw_only=True``: msgspec applies it per class."""


# -- details, one type per kind --------------------------------------------------------------


class Side(_Part, kw_only=True):
    """One side of a replicated output: ranks whose outputs hashed alike."""

    ranks: list[int]  # ascending
    hash: str  # the output's 128-bit hash, 32 hex digits
    sum: float | None = None  # float64 sum of the output; omitted unless every rank summed it
    absmax: float | None = None  # largest |element| of the output; omitted like ``sum``


class RankSum(_Part, kw_only=True):
    """One rank's output checked against the float64 sum of everyone's inputs."""

    expected_sum: float  # what the output should sum to: Σ over ranks of their inputs (of
    #                      their chunk for this rank in a reduce_scatter; ÷ world size for AVG)
    output_sum: float  # what it sums to (may be Infinity or NaN)
    abs_err: float  # |output_sum − expected_sum|
    tolerance: float  # the bound a correct reduction stays within (dtype, world, size)


class TieBreak(_Part, kw_only=True):
    """How the records settled a tie (sides of equal size, e.g. two ranks that disagree),
    or why they could not. ``by`` names the evidence: ``reduction`` (each side's output sum
    against the reduction of every rank's input sum, see docs/decisions.md), ``root_input``
    (broadcast: the output that hashes like the root's input is right) or ``""`` (none
    applied)."""

    by: str
    decided: bool  # one side's output is right by this evidence: the others are culprits
    evidence: str  # one sentence: what the records say (decided) or why they cannot decide
    ranks: dict[str, RankSum] = {}  # by="reduction": each side's first rank's check;
    #                                 omitted otherwise


class ValueMismatch(_Part, kw_only=True):
    """``value_mismatch``: outputs that must be bit-identical on every rank differ
    (all_reduce, broadcast, all_gather*). Culprits: the ranks outside the majority; on a
    tie the ranks the evidence (``tie``) blames, or every rank when it cannot decide
    (ambiguous). Ranks whose output a ``link_corruption`` of the same collective explains
    take no part in the vote."""

    sides: list[Side]  # largest first (equal sizes: lowest rank first); [0] is the majority
    #                    (on a tie settled by evidence: the right side)
    sum_abs_diff: float | None = None  # max |culprit's sum − majority's sum|; omitted for an
    #                                    ambiguous tie, or when some rank did not sum its output
    sum_rel_diff: float | None = None  # sum_abs_diff / |majority's sum|; omitted likewise
    tie: TieBreak | None = None  # on a tie: how the records settled it or why not; omitted
    #                              when a majority decided
    injected: bool = False  # commcheck's fault injection altered this call; omitted if not


class Divergence(ValueMismatch, kw_only=True):
    """``grad_divergence`` / ``param_divergence``: the gradient probe's
    :class:`ValueMismatch`. Each replica's gradient after reduction (or parameter after the
    step) differs. The finding's group is ``grad:<parameter>`` or ``param:<parameter>``. It is
    reported at the first diverging step of the parameter only."""

    later_steps: int  # later steps of this parameter that diverged again (counted, not repeated)


class LinkCorruption(_Part, kw_only=True):
    """``link_corruption``: chunks that the culprit (the receiver) got do not hash like what
    their senders sent."""

    links: list[tuple[int, int]]  # (src, dst) per corrupted chunk; dst is the culprit
    injected: bool = False  # commcheck's fault injection altered this call; omitted if not


class ReductionError(_Part, kw_only=True):
    """``reduction_error``: a reduction's output is not the sum of its inputs (all_reduce,
    reduce, reduce_scatter). Culprits: the ranks whose output is wrong. None when every
    rank's output is wrong (ambiguous: consistent, and wrong)."""

    ranks: dict[str, RankSum]  # by rank, each rank whose output is off
    injected: bool = False  # commcheck's fault injection altered this call; omitted if not


class Variant(_Part, kw_only=True):
    """What one side of a desync called (as one of its ranks reported it)."""

    ranks: list[int]  # ascending
    op: str
    dtype: str
    numel_in: int
    numel_out: int
    shape_in: list[int]
    redop: str  # reduce op ("SUM", "AVG", ...; "" for none)
    root: int  # global rank of root/src/dst; -1 for none
    splits: tuple[list[int], list[int]]  # input split sizes, output split sizes
    callsites: list[str]  # every call site of the side's ranks, sorted


class Desync(_Part, kw_only=True):
    """``desync``: members of one collective disagree on what they call, seen when they
    enter it. Culprits: the ranks outside the majority variant, or every rank when
    ambiguous."""

    fields: list[str]  # what differs: names from wire.ops.AGREE_ALL; for send/recv, "dtype"
    #                    or "numel" (the sender's numel_in against the receiver's numel_out)
    variants: list[Variant]  # largest first (equal sizes: lowest rank first)


class LastCall(_Part, kw_only=True):
    """The last collective a missing rank entered."""

    op: str
    at: str  # "<group> seq <n>", e.g. "0[0-3] seq 12"
    callsite: str
    ago_s: float | None  # seconds from entering it to the check; null at the end of a run
    said_goodbye: bool  # the rank ended its run normally


class MissingRank(_Part, kw_only=True):
    """``missing_rank``: some members entered a collective and waited past the hang timeout
    (or to the end of the run) for members that never entered. Culprits: the ranks that
    never entered. Reported once per group and set of missing ranks: later collectives of
    the group that the same ranks never entered are counted here, not reported. A
    collective only dead ranks (``rank_died``) are missing from is not reported at all."""

    waiting: list[int]  # the ranks that entered, ascending
    waited_s: float | None  # how long the first of them had waited; null at the end of a run
    not_waiting: dict[str, str] = {}  # by rank that entered and is not known to be alive
    #   and blocked in it when reported: "crashed" (its call raised: ``crashed`` says
    #   what), "died" (its process ended), "stopped" (SIGSTOP, a debugger), "finished"
    #   (said goodbye), "silent" (no relay sees it and it sent nothing for the hang
    #   timeout: no longer reporting); omitted when empty
    crashed: dict[str, str] = {}  # by rank whose call of it raised after torch accepted
    #   it: the exception's type and first line ("RuntimeError: Connection closed by
    #   peer ..."), as the rank said; omitted when empty
    last: dict[str, LastCall | None]  # by missing rank; null if it never entered a collective
    #                                   (that its shard saw, with ``collect --shards``)
    later_collectives: int = 0  # later collectives of the group the same ranks never
    #                             entered (counted, not repeated); omitted while 0
    then_gone: list[int] = []  # ranks that ended without a goodbye after it was reported:
    #   its own, or any stopped by SIGTERM/SIGINT/SIGHUP (a launcher cancelling the stalled
    #   job): consequences, not rank_died findings; omitted when empty


class CallAt(_Part, kw_only=True):
    """One collective a rank took part in."""

    op: str
    at: str  # "<group> seq <n>"
    callsite: str


class WaitingIn(_Part, kw_only=True):
    """A collective others wait in for a dead rank."""

    op: str
    at: str  # "<group> seq <n>"
    callsite: str  # where the first of them called it
    ranks: list[int]  # the members that entered it and did not complete it, ascending
    crashed: dict[str, str] = {}  # those of them whose call raised (a peer's death shows as
    #                               an error, e.g. gloo's "Connection closed by peer"):
    #                               by rank, the exception's type and first line; omitted
    #                               when empty


class RankDied(_Part, kw_only=True):
    """``rank_died``: a rank's process ended (or is a zombie) and the rank never said
    goodbye, as its node's relay saw it; reported once per rank, at the first hang check
    after, without waiting for the hang timeout. Culprits: that rank. The finding's
    op/group/seq/callsite are its last entered collective (or, if none, its last
    completed one; "" and seq -1 if it had none). Collectives of its groups that it did not
    complete and that others entered are counted here; those it alone (with other dead
    ranks) is missing from, or stuck in, are not reported as missing_rank or hang."""

    pid: int = 0  # its process id, when the relay knew it; omitted if not
    exit_code: int | None = None  # its exit status, when seen; omitted if not
    signal: int | None = None  # the signal that ended it, when seen; omitted if not
    last_completed: CallAt | None  # the last collective it completed; null if none was seen
    last_entered: CallAt | None = None  # the last collective it entered, if it never
    #                                     completed it; omitted otherwise
    waiting: list[WaitingIn]  # what the other members wait in: the oldest (at most 16)
    #                           open collectives of its groups it did not complete and
    #                           others entered, when it was reported
    collectives_left_waiting: int  # all such collectives then, and those that timed out
    #                                later waiting only on dead ranks
    then_gone: list[int] = []  # ranks that died after it while waiting for it, or stopped
    #                            by SIGTERM/SIGINT/SIGHUP after it (a launcher tearing the
    #                            job down): consequences, not findings of their own


class Doing(_Part, kw_only=True):
    """What some members of a hung collective were doing when it was reported."""

    ranks: list[int]  # ascending
    condition: str  # dead, frozen, blocked, progressing or finished (engine.state.Condition),
    #                 or "crashed": their call of it raised (``error``)
    op: str | None  # the last collective they entered; null if none was seen
    at: str | None  # "<group> seq <n>" of it
    callsite: str | None
    idle_s: float | None = None  # the longest any of them had written no record, as the
    #                              relay saw it; omitted without liveness
    error: str | None = None  # crashed: the exception's type and first line; omitted
    #                           otherwise


class Hang(_Part, kw_only=True):
    """``hang``: every member entered a collective and not all completed it, the last one
    entering ``hang_timeout`` s ago (or by the end of the run): the usual shape of a hung
    NCCL collective. Culprits: the members liveness shows stopped, silent outside any
    collective (frozen) or dead; when it shows none (or there is no liveness), every
    member that did not complete, ambiguous. Reported once per group: later hung
    collectives of the group are counted here."""

    not_completed: list[int]  # the members that did not complete it, ascending
    waited_s: float | None  # since the last member entered; null at the end of a run
    doing: list[Doing]  # every member, grouped by what it was doing: dead and frozen first
    later_collectives: int = 0  # later hung collectives of the group (counted, not
    #                             repeated); omitted while 0
    then_gone: list[int] = []  # ranks that ended without a goodbye after it was reported:
    #   its members, or any stopped by SIGTERM/SIGINT/SIGHUP (a launcher cancelling the
    #   hung job): consequences, not rank_died findings; omitted when empty


class NanInfCount(_Part, kw_only=True):
    """What one rank's tensor held."""

    nan: int  # NaN elements
    inf: int  # ±Inf elements


class NanInf(_Part, kw_only=True):
    """``nan_inf``: the first collective of a group (of a replica set, for the gradient
    probe) whose inputs carried NaN or Inf. Culprits: the ranks that sent them. Later
    collectives that carry them too are counted here, not reported."""

    inputs: dict[str, NanInfCount]  # by culprit rank: its inputs (the probe: the tensor)
    later_collectives_with_nan_inf: int
    injected: bool = False  # commcheck's fault injection altered this call; omitted if not


class Straggler(_Part, kw_only=True):
    """``straggler``: once per rank (or node pair) and episode, while it makes the others
    wait (docs/stragglers.md). ``cause`` "rank": it arrived last in a clear majority of a
    group's recent collectives and cost the others a material share of their time
    (compute, host or GPU); culprits: that rank. ``cause`` "link": members arrive together
    but exchanges between two hosts take far longer than between other host pairs;
    culprits: none, ``link`` names the pair. The finding's op/group/seq are the collective
    at which it was found, its step the episode's first step, its callsite where the others
    waited. Arrival order comes from each member's own wait, never from comparing clocks."""

    cause: str  # "rank" or "link"
    rank: int | None  # the slow rank; null for a link
    host: str  # its host; "" for a host pair's link; the node, for a node's links
    link: list[str] = []  # cause link: the two hosts, sorted, or the node whose links are
    #                       slow (alone); omitted otherwise
    ranks: list[int] = []  # cause link: the ranks whose exchanges were slow; omitted otherwise
    groups: list[str]  # the groups whose windows found it, sorted
    window: int  # collectives (exchanges, for a link) in the window that found it
    last_share: float  # share of them it arrived last in (a link: 0)
    waiting_share: float = 0.0  # share of the others' waiting in them that was for it;
    #                             omitted for a link
    wall_pct: float  # % of the others' wall time over that window spent waiting for it
    cost_s: float  # seconds the others waited for it over the episode (summed over them)
    cost_pct: float  # cost_s as % of their time in those collectives
    median_gap_ms: float  # rank: median of how far behind the previous arrival it came
    #                       where it was clearly late; link: median transfer of the slow pair
    baseline_ms: float = 0.0  # link: median transfer of the other host pairs; omitted for a rank
    start_step: int  # the step the episode started at (the window's change point)
    waited_at: str  # the call site where the others waited most
    ended: bool = False  # the episode ended; omitted while it lasts
    end_step: int | None = None  # the step it ended at; omitted while it lasts
    end_t: float | None = None  # when it ended (member 0's clock); omitted while it lasts


Detail = ValueMismatch | Divergence | LinkCorruption | ReductionError | Desync | MissingRank | \
    NanInf | RankDied | Hang | Straggler
DETAILS: dict[Kind, type[Detail]] = {
    Kind.VALUE_MISMATCH: ValueMismatch, Kind.LINK_CORRUPTION: LinkCorruption,
    Kind.REDUCTION_ERROR: ReductionError, Kind.DESYNC: Desync, Kind.MISSING_RANK: MissingRank,
    Kind.NAN_INF: NanInf, Kind.GRAD_DIVERGENCE: Divergence, Kind.PARAM_DIVERGENCE: Divergence,
    Kind.RANK_DIED: RankDied, Kind.HANG: Hang, Kind.STRAGGLER: Straggler,
}
# Kinds that, once true, stay true for a group (or a group and its missing ranks): reported
# once, later occurrences counted in this detail field. The engine's ``onsets`` hold them;
# the collector rewrites their stored detail at every commit.
FOLDED: dict[Kind, str] = {Kind.NAN_INF: "later_collectives_with_nan_inf",
                           Kind.GRAD_DIVERGENCE: "later_steps",
                           Kind.PARAM_DIVERGENCE: "later_steps",
                           Kind.MISSING_RANK: "later_collectives",
                           Kind.HANG: "later_collectives"}

D = TypeVar("D", bound=Detail)


class Finding(msgspec.Struct, Generic[D], kw_only=True):
    """One thing that went wrong in one collective (or one probe step). Read one with
    :meth:`from_json`. ``msgspec.convert(obj, Finding)`` cannot tell which detail type
    applies, because the kind says that and the detail types carry no tag of their own."""

    kind: Kind
    run: str  # the run id the ranks reported under
    op: str  # the collective, as wire.ops names it ("all_reduce", "send", "grad", ...)
    group: str  # name[ranks], e.g. "0[0-3]", "tp[4,6]" (see engine.model.group_label)
    seq: int  # the call's sequence number in its group
    step: int  # the training step (the lowest any member reported)
    culprits: list[int]  # ascending; ambiguous: every rank of every side (reduction: none)
    hosts: list[str]  # the culprits' hosts (every member's when there is no culprit), sorted
    callsite: str  # "path:line function" where the first culprit called it (missing_rank:
    #                the first waiting rank; rank_died: see RankDied)
    detail: D  # by kind, see DETAILS
    ambiguous: bool = False  # the evidence cannot single out culprits: a tie, or a reduction
    #                          wrong on every rank
    t: float = 0.0  # ranks' wall clock, s: the last member's completion (desync: entry;
    #                 missing_rank: the first waiting rank's entry; hang: the last
    #                 member's entry; rank_died: when the relay saw it gone)

    @property
    def injected(self) -> bool:
        """commcheck's own fault injection caused it (a test or demo, not the hardware)."""
        return getattr(self.detail, "injected", False)

    def to_json(self) -> dict:
        """The JSON form as Python values (pairs stay tuples, ``kind`` becomes a str)."""
        return msgspec.to_builtins(self)

    @classmethod
    def from_json(cls, obj: dict) -> Finding:
        """A finding from its JSON form (a stored row, a shard's message). Raises
        ValueError (an unknown kind) or msgspec.ValidationError (a misshapen field)."""
        return msgspec.convert(obj, cls[DETAILS[Kind(obj["kind"])]])


# -- suspects and summary --------------------------------------------------------------------


class Suspect(msgspec.Struct, kw_only=True, tag_field="kind"):
    """What the findings together point at. ``kind`` comes first in the JSON and names the
    type: host, rank, link, sender or receiver."""

    @property
    def kind(self) -> str:
        return type(self).__struct_config__.tag


class HostSuspect(Suspect, kw_only=True, tag="host"):
    """Every unambiguous finding, or ≥ 3 of them and ≥ 75 %, names a culprit on one host
    (of a multi-host job)."""

    host: str
    findings: int  # unambiguous findings naming a culprit on this host (once each)
    of: int  # unambiguous findings with culprits
    ranks: list[int]  # the culprits on this host, ascending


class RankAt(msgspec.Struct, kw_only=True):
    """A rank and its host ("" if it never reported)."""

    rank: int
    host: str


class RankSuspect(Suspect, kw_only=True, tag="rank", omit_defaults=True):
    """One rank is a culprit in every finding (of two or more); ranks named alike in every
    finding are all named (``alike``), never one picked among them."""

    rank: int  # the lowest of them
    host: str  # "" if it never reported
    findings: int
    of: int  # all findings
    alike: list[RankAt] = []  # the other ranks culprit in every finding; omitted if none


class LinkSuspect(Suspect, kw_only=True, tag="link"):
    """One link carried at least half of the corrupted chunks (of two or more)."""

    src: int
    dst: int
    src_host: str  # "" if it never reported
    dst_host: str
    chunks: int  # corrupted chunks on this link
    of: int  # corrupted chunks on every link


class _EndSuspect(Suspect, kw_only=True):
    rank: int
    host: str
    chunks: int  # corrupted chunks this rank sent (sender) or received (receiver)
    of: int  # corrupted chunks on every link


class SenderSuspect(_EndSuspect, kw_only=True, tag="sender"):
    """One rank sent ≥ 75 % of the corrupted chunks, to more than one peer."""


class ReceiverSuspect(_EndSuspect, kw_only=True, tag="receiver"):
    """One rank received ≥ 75 % of the corrupted chunks, from more than one peer."""


AnySuspect = HostSuspect | RankSuspect | LinkSuspect | SenderSuspect | ReceiverSuspect


class LastEntered(_Part, kw_only=True):
    """The last collective a rank entered, as the collector last knew it."""

    op: str
    at: str  # "<group> seq <n>"
    callsite: str
    t: float  # when it entered (the rank's clock, seconds since the epoch)


class Unfinished(_Part, kw_only=True):
    """A rank that did not end its run normally: it never said goodbye, or never reported."""

    rank: int
    host: str = ""  # empty when it never reported
    never_reported: bool = False  # the world size names it, but nothing came from it
    last: LastEntered | None = None  # the last collective it entered; null if none
    # never_reported only: the last rank of a span of such ranks (rank..through), one entry
    # for a node that never started rather than one per rank; null for one rank
    through: int | None = None

    @property
    def count(self) -> int:
        return 1 if self.through is None else self.through - self.rank + 1

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.through is None else \
            f"ranks {self.rank}-{self.through}"


class OpTally(_Part, kw_only=True):
    """One op name as recorded (``all_reduce``, ``ddp_allreduce``, ``ddp_bucket``,
    ``all_gather_single`` for the functional all_gather_tensor, ...): what was checked."""

    op: str
    recorded: int  # completed calls recorded, summed over ranks
    verified: int  # collectives every member reported, and checked


class Stopped(_Part, kw_only=True):
    """Ranks of a run stopped together by a signal (a scheduler's cancel, a time limit):
    every rank at once, none failed first, so their deaths are nobody's finding."""

    ranks: list[int]  # ascending
    signal: int  # the stop signal (15: SIGTERM)


class Outage(_Part, kw_only=True):
    """Ranks whose node relay could not reach the collector (a late collector, a cut link):
    for how long in all, how often, what it sent again, and what was lost meanwhile."""

    ranks: list[int]  # ascending; one relay's ranks share an outage
    seconds: float  # in all
    outages: int  # times (messages waited >= max(5 s, 2 x ack_timeout) for an ack)
    resent: int  # their messages sent again (no ack in time)
    dropped: int  # their records dropped on the ranks (0: nothing lost)


class RefusedSender(msgspec.Struct, kw_only=True):
    """A sender the collector refused: ``who`` names it (a client key and address, an
    address and why its handshake failed, or the pid, host, rank and run it claimed);
    ``count`` is its refused messages, or for ``auth``/``auth_handshake`` its refused
    connection attempts (a refused sender keeps reconnecting)."""

    reason: str
    who: str
    count: int


class Failed(_Part, kw_only=True):
    """Ranks whose goodbye said training did not end well (issue 29): an exception nobody
    caught, a non-zero exit status, or a stop signal. An exception still runs the exit
    handlers, so these ranks said goodbye: without this a crashed run read clean."""

    ranks: list[int]  # ascending
    how: str  # "exception", "exit" (a non-zero status) or "signal" (wire.ENDINGS)
    error: str = ""  # the exception's type and first line, the lowest rank's; omitted if none
    exit_code: int | None = None  # the exit status, when known; omitted if not
    signal: int | None = None  # the stop signal it got; omitted if none
    alike: bool = False  # the ranks' errors differ in numbers only (each its own rank or
    #                      port): ``error`` is the lowest rank's; omitted if not


class RankLateness(_Part, kw_only=True):
    """How one rank (or host) arrived at the collectives it took part in (docs/stragglers.md):
    who waited for whom, from each member's own wait."""

    rank: int | None = None  # the rank; omitted in a per-host row
    host: str
    ranks: list[int] = []  # a per-host row: its ranks; omitted in a per-rank row
    collectives: int  # completed collectives it took part in (every member reported)
    last: int  # those it arrived last in
    last_pct: float  # last / collectives, %
    median_gap_ms: float  # when last, how far behind the previous arrival: the median by
    #                       time (half its lateness came in gaps at least this long), to a
    #                       factor of √2 (log2 bins); 0 if never last
    wait_s: float  # its own time waiting in collectives
    cost_s: float  # the others' time waiting for it (summed over them)


class Summary(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The run at a glance: counts, what was not checked, and what the findings point at.
    Fields with a default are left out of the JSON while they hold it."""

    suspects: list[AnySuspect]  # strongest first: host, rank, link, sender, receiver
    link_matrix: list[tuple[int, int, int]]  # (src, dst, corrupted chunks), sorted
    findings: int
    records: int  # records the database holds (none if the collector kept none)
    verified: int  # collectives every member reported, and checked
    unmatched: int  # collectives some member never reported (dropped records, dead ranks)
    rejected: dict[str, int]  # messages the collector refused, by reason
    runs: list[str]  # run ids seen in records, sorted
    ranks: int  # ranks the collector heard from
    ranks_said_goodbye: int  # ranks that ended their run normally
    dropped_on_ranks: int  # records the ranks dropped (bounded memory; counted, not sent)
    spilled_on_ranks: int  # records the ranks spilled to disk (collector away or slow)
    not_checked_on_ranks: int  # calls the wrappers saw and could not check
    bypassed: dict[str, int]  # by group: collectives that never passed a wrapper
    by_kind: dict[Kind, int]  # findings per kind, in order of first appearance
    by_rank: dict[str, int]  # by rank: findings that name it a culprit
    by_host: dict[str, int]  # by host: findings that name it (Finding.hosts)
    first_divergence: Finding | None  # the earliest finding by (step, t); null if none
    world: int = 0  # the job's world size, as the ranks reported it; 0: unknown
    unfinished: list[Unfinished] = []  # ranks that never said goodbye or never reported
    ops: list[OpTally] = []  # per op name, what was recorded and verified; omitted when the
    #                          database holds no per-op counts (an older collector)
    bypassed_ddp: dict[str, int] = {}  # by group: the part of ``bypassed`` that was DDP's
    # own C++ traffic (construction, bucket rebuild)
    not_verified: int = 0  # collectives left unverified by records ranks said they dropped
    not_verified_by_rank: dict[str, int] = {}  # by rank: those its own drops left unverified
    outages: list[Outage] = []  # the relays' links to the collector, when they were down
    stopped: list[Stopped] = []  # runs stopped together (a cancelled job), by signal
    unfired_faults: list[FaultTally] = []  # by rank: injected faults that never fired
    not_checked_reasons: dict[str, int] = {}  # part of not_checked_on_ranks, by reason
    # part of not_verified: collectives whose records were lost (damaged in a ring,
    # rejected), not dropped, and by rank (not in not_verified_by_rank)
    not_verified_lost: int = 0
    not_verified_lost_by_rank: dict[str, int] = {}
    refused: list[RefusedSender] = []  # the senders behind ``rejected``'s refusals, named
    open_collector: bool = False  # the collector ran without CURVE keys: any local process
    # (any host, off loopback) could send as the job's ranks
    refused_files: dict[str, list[int]] = {}  # another user's file that stood in ranks' way
    # (its path and why, as the ranks said it): they recorded around it, in private places
    failed: list[Failed] = []  # ranks whose goodbye said training failed, alike together
    thread_errors: dict[str, str] = {}  # by rank: the first exception that ended another
    #                                     thread of it (the process went on)
    unverified_share: float = 0.0  # not_verified / (verified + not_verified); omitted at 0
    lateness: list[RankLateness] = []  # per rank, most costly to the others first; omitted
    #                                    from a collector that did not time arrivals
    lateness_by_host: list[RankLateness] = []  # the same per host


class Report(msgspec.Struct, kw_only=True):
    """What ``commcheck report --json`` prints."""

    findings: list[Finding]  # in order of t, then of storage
    summary: Summary

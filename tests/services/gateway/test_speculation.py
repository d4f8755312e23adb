import time

from services.gateway.speculation import next_draft_context


def test_draft_context_numbers_increase_and_start_above_a_restarted_gateways():
    """Microseconds of the clock: a gateway started later numbers above an earlier one's contexts
    (whose last number cannot be ahead of the clock), so a reused request id is never refused."""
    before = time.time_ns() // 1000
    numbers = [next_draft_context() for _ in range(1000)]
    assert numbers == sorted(set(numbers)) and numbers[0] >= before

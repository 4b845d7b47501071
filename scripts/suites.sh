# The suite runner behind scripts/test.sh, sourced (not run): every suite runs, each gets one
# result line, and a summary at the end says what passed, failed and was skipped, and why.
#
#   source scripts/suites.sh
#   suite lint my_lint_function          # runs it in a subshell; a failure is recorded, not fatal
#   skip slow "KVSTORE_SKIP_SLOW=1"      # recorded as skipped, with the reason
#   summary                              # prints the table; returns 1 if any suite failed
#
# With KVSTORE_TEST_DRY_RUN=1, `suite` prints what it would run and runs nothing (scripts/test.sh
# then skips its set-up too): a cheap way to see, and to test, which suites a run has.
# Ctrl-C during a suite records it as interrupted, prints the summary and exits 130.

_SUITE_NAMES=()
_SUITE_STATES=()
_SUITE_NOTES=()
_SUITE_CURRENT=""

_suite_record() {
    _SUITE_NAMES+=("$1")
    _SUITE_STATES+=("$2")
    _SUITE_NOTES+=("$3")
}

_suite_interrupted() {
    if [ -n "$_SUITE_CURRENT" ]; then
        _suite_record "$_SUITE_CURRENT" "interrupted" "Ctrl-C"
        echo "--- $_SUITE_CURRENT: interrupted"
    fi
    summary
    exit 130
}

# What a suite runs, quoted as a shell would need it; a function shows its body on one line.
_suite_describe() {
    if declare -F "$1" >/dev/null; then
        declare -f "$1" | sed '1,2d;$d' | sed 's/^ *//' | paste -sd ' '
    else
        printf '%q ' "$@" | sed 's/ $//'
    fi
}

# suite NAME COMMAND [ARGS...]: run COMMAND (a program or a shell function) in a subshell, so
# that its `exit` or a `set -e` inside it ends only the suite; print one result line.
suite() {
    local name="$1"
    shift
    local what
    what=$(_suite_describe "$@")
    if [ "${KVSTORE_TEST_DRY_RUN:-0}" = "1" ]; then
        echo "--- $name: would run: $what"
        _suite_record "$name" "listed" "not run (dry run)"
        return 0
    fi
    echo "--- $name: $what"
    local started=$SECONDS rc=0
    _SUITE_CURRENT="$name"
    trap _suite_interrupted INT TERM
    ("$@") || rc=$?
    trap - INT TERM
    _SUITE_CURRENT=""
    local took=$((SECONDS - started))
    if [ "$rc" -eq 0 ]; then
        echo "--- $name: ok (${took}s)"
        _suite_record "$name" "ok" "${took}s"
    else
        echo "--- $name: FAILED (exit $rc, ${took}s)"
        _suite_record "$name" "FAILED" "exit $rc, ${took}s"
    fi
}

# skip NAME REASON: a suite left out on purpose.
skip() {
    echo "--- $1: skipped ($2)"
    _suite_record "$1" "skipped" "$2"
}

# summary: one line per suite, then the verdict; returns 1 if any suite failed or was interrupted.
summary() {
    local i failed=() skipped=0 ran=0
    echo "=== summary"
    for i in "${!_SUITE_NAMES[@]}"; do
        printf '  %-12s %-18s %s\n' "${_SUITE_STATES[$i]}" "${_SUITE_NAMES[$i]}" "${_SUITE_NOTES[$i]}"
        case "${_SUITE_STATES[$i]}" in
            FAILED | interrupted) failed+=("${_SUITE_NAMES[$i]}"); ran=$((ran + 1)) ;;
            skipped) skipped=$((skipped + 1)) ;;
            *) ran=$((ran + 1)) ;;
        esac
    done
    if [ "${#failed[@]}" -gt 0 ]; then
        echo "=== FAILED: ${#failed[@]} of $ran suites (${failed[*]}); $skipped skipped"
        return 1
    fi
    if [ "${KVSTORE_TEST_DRY_RUN:-0}" = "1" ]; then
        echo "=== dry run (KVSTORE_TEST_DRY_RUN=1): $ran suites listed, none run; $skipped skipped"
        return 0
    fi
    echo "=== passed: $ran suites; $skipped skipped"
    return 0
}

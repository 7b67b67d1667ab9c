//! The summary table: one row per case, printed where CI logs show it.

use std::io::Write;

/// How one case went.
#[derive(Debug)]
pub struct Outcome {
    /// Short name of the case.
    pub case: &'static str,
    /// What must happen.
    pub expected: &'static str,
    /// What happened, with the numbers measured.
    pub observed: String,
    /// Whether the observation meets the expectation.
    pub passed: bool,
}

/// First and last lines of the table in the inner run's output, for [`forward`].
const BEGIN: &str = "==== escape suite ====";
const END: &str = "==== end of escape suite ====";

/// The table as text, between the [`BEGIN`] and [`END`] lines.
fn render(outcomes: &[Outcome]) -> String {
    let passed = outcomes.iter().filter(|o| o.passed).count();
    let mut text = format!("{BEGIN}\n| case | expected | observed | result |\n|---|---|---|---|\n");
    for o in outcomes {
        let result = if o.passed { "PASS" } else { "FAIL" };
        let observed = o.observed.replace('\n', " / ").replace('|', "/");
        text.push_str(&format!(
            "| {} | {} | {observed} | {result} |\n",
            o.case, o.expected
        ));
    }
    text.push_str(&format!(
        "{passed} of {} cases passed\n{END}\n",
        outcomes.len()
    ));
    text
}

/// Prints the table: on stderr when the cases ran in this process's test (uncaptured, so it
/// shows in CI logs); on stdout inside the test host, where the delegating run picks it up (and
/// shows it with the rest of the output when the run fails).
pub fn print(outcomes: &[Outcome]) {
    let text = render(outcomes);
    if std::env::var_os("BULKHEAD_IN_TESTHOST").is_some() {
        let mut out = std::io::stdout();
        let _ = out.write_all(text.as_bytes());
        let _ = out.flush();
    } else {
        let _ = std::io::stderr().write_all(text.as_bytes());
    }
}

/// Copies the table from the inner run's `stdout` to this process's stderr.
pub fn forward(stdout: &str) {
    let Some(start) = stdout.find(BEGIN) else {
        let _ = std::io::stderr().write_all(b"escape suite: no table in the inner run's output\n");
        return;
    };
    let table = &stdout[start..];
    let end = table.find(END).map_or(table.len(), |i| i + END.len());
    let _ = std::io::stderr().write_all(format!("{}\n", &table[..end]).as_bytes());
}

//! Per-backend reports: a readable table, a closing count line, and JUnit XML.

use std::fmt::Write as _;
use std::time::Duration;

/// A case's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every check held.
    Passed,
    /// Not run, with the reason (a missing capability). Never counted as passed.
    Skipped(String),
    /// A check failed, with the message.
    Failed(String),
}

/// One case's line in a report.
#[derive(Debug, Clone)]
pub struct CaseReport {
    /// The case's name.
    pub name: &'static str,
    /// Its verdict.
    pub verdict: Verdict,
    /// How long it took.
    pub duration: Duration,
    /// The seed it ran with (absent for skips).
    pub seed: Option<u64>,
}

impl CaseReport {
    /// A line.
    pub fn new(
        name: &'static str,
        verdict: Verdict,
        duration: Duration,
        seed: Option<u64>,
    ) -> Self {
        CaseReport {
            name,
            verdict,
            duration,
            seed,
        }
    }
}

/// The report of one run against one backend.
#[derive(Debug, Clone)]
pub struct Report {
    /// The backend's name.
    pub backend: String,
    /// The run's base seed (`CONFORMANCE_SEED=<seed>` reruns it).
    pub seed: u64,
    /// The cases, in run order.
    pub cases: Vec<CaseReport>,
}

impl Report {
    /// An empty report.
    pub fn new(backend: String, seed: u64) -> Self {
        Report {
            backend,
            seed,
            cases: Vec::new(),
        }
    }

    /// Adds a line.
    pub fn push(&mut self, c: CaseReport) {
        self.cases.push(c);
    }

    fn count(&self, f: impl Fn(&Verdict) -> bool) -> usize {
        self.cases.iter().filter(|c| f(&c.verdict)).count()
    }

    /// Cases passed.
    pub fn passed(&self) -> usize {
        self.count(|v| matches!(v, Verdict::Passed))
    }

    /// Cases failed.
    pub fn failed(&self) -> usize {
        self.count(|v| matches!(v, Verdict::Failed(_)))
    }

    /// Cases skipped.
    pub fn skipped(&self) -> usize {
        self.count(|v| matches!(v, Verdict::Skipped(_)))
    }

    /// The table and the closing line, as text.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "conformance suite: backend {} (seed {})",
            self.backend, self.seed
        );
        for c in &self.cases {
            let (label, detail) = match &c.verdict {
                Verdict::Passed => ("ok", String::new()),
                Verdict::Skipped(why) => ("SKIPPED", format!(": {why}")),
                Verdict::Failed(why) => ("FAILED", format!(": {why}")),
            };
            let _ = writeln!(
                s,
                "  {:<62} {:<8} {:>8.3}s{}",
                format!("{}::{}", self.backend, c.name),
                label,
                c.duration.as_secs_f64(),
                detail
            );
            if let (Verdict::Failed(_), Some(seed)) = (&c.verdict, c.seed) {
                let _ = writeln!(
                    s,
                    "      rerun with CONFORMANCE_SEED={} and filter {:?} (case seed {seed})",
                    self.seed, c.name
                );
            }
        }
        let _ = writeln!(
            s,
            "{}: {} passed, {} failed, {} skipped",
            self.backend,
            self.passed(),
            self.failed(),
            self.skipped()
        );
        let _ = writeln!(
            s,
            "{} passed, {} failed, {} skipped",
            self.passed(),
            self.failed(),
            self.skipped()
        );
        s
    }

    /// Prints [`Report::render`] to stdout.
    pub fn print(&self) {
        print!("{}", self.render());
    }

    /// The report as a JUnit XML document (one `testsuite`).
    pub fn junit(&self) -> String {
        junit(std::slice::from_ref(self))
    }
}

fn xml_escape(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            '&' => "&amp;".into(),
            '<' => "&lt;".into(),
            '>' => "&gt;".into(),
            '"' => "&quot;".into(),
            '\'' => "&apos;".into(),
            c if c.is_control() && c != '\n' && c != '\t' => format!("&#{};", c as u32),
            c => c.to_string(),
        })
        .collect()
}

/// Several reports as one JUnit XML document (one `testsuite` per backend).
pub fn junit(reports: &[Report]) -> String {
    let mut s = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites>\n");
    for r in reports {
        let total: f64 = r.cases.iter().map(|c| c.duration.as_secs_f64()).sum();
        let _ = writeln!(
            s,
            "  <testsuite name=\"conformance.{}\" tests=\"{}\" failures=\"{}\" skipped=\"{}\" time=\"{:.3}\">",
            xml_escape(&r.backend),
            r.cases.len(),
            r.failed(),
            r.skipped(),
            total
        );
        let _ = writeln!(
            s,
            "    <properties><property name=\"seed\" value=\"{}\"/></properties>",
            r.seed
        );
        for c in &r.cases {
            let _ = write!(
                s,
                "    <testcase classname=\"conformance.{}\" name=\"{}\" time=\"{:.3}\"",
                xml_escape(&r.backend),
                xml_escape(c.name),
                c.duration.as_secs_f64()
            );
            match &c.verdict {
                Verdict::Passed => s.push_str("/>\n"),
                Verdict::Skipped(why) => {
                    let _ = writeln!(s, "><skipped message=\"{}\"/></testcase>", xml_escape(why));
                }
                Verdict::Failed(why) => {
                    let _ = writeln!(s, "><failure message=\"{}\"/></testcase>", xml_escape(why));
                }
            }
        }
        s.push_str("  </testsuite>\n");
    }
    s.push_str("</testsuites>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_junit() {
        let mut r = Report::new("mem".into(), 7);
        r.push(CaseReport::new(
            "a",
            Verdict::Passed,
            Duration::from_millis(5),
            Some(1),
        ));
        r.push(CaseReport::new(
            "b",
            Verdict::Skipped("no <server>".into()),
            Duration::ZERO,
            None,
        ));
        r.push(CaseReport::new(
            "c",
            Verdict::Failed("x & y".into()),
            Duration::ZERO,
            Some(3),
        ));
        assert_eq!((r.passed(), r.failed(), r.skipped()), (1, 1, 1));
        let text = r.render();
        assert!(
            text.contains("mem::b") && text.contains("SKIPPED") && text.contains(": no <server>"),
            "{text}"
        );
        assert!(
            text.trim_end().ends_with("1 passed, 1 failed, 1 skipped"),
            "{text}"
        );
        assert!(text.contains("CONFORMANCE_SEED=7"), "{text}");
        let x = r.junit();
        assert!(
            x.contains("<skipped message=\"no &lt;server&gt;\"/>"),
            "{x}"
        );
        assert!(x.contains("<failure message=\"x &amp; y\"/>"), "{x}");
        assert!(
            x.contains("tests=\"3\" failures=\"1\" skipped=\"1\""),
            "{x}"
        );
    }
}

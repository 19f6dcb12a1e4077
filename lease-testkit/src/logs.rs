//! [`CapturedLogs`]: every log line of the test process, kept for assertions.

use std::sync::{Arc, Mutex};

/// The text of every event logged through the process-wide `tracing` subscriber that
/// [`CapturedLogs::install`] sets (no colours), for tests that check what was logged: a secret
/// that must never show, a warning that must show exactly once.
///
/// The subscriber is global, not scoped: `tracing` caches each call site's interest
/// process-wide, so a scoped subscriber misses call sites that other threads registered first,
/// and an adapter's background tasks run on the runtime's other threads. So each test binary can
/// install it once; its other tests log into it too.
#[derive(Clone, Default)]
pub struct CapturedLogs(Arc<Mutex<Vec<u8>>>);

impl CapturedLogs {
    /// Sets the process-wide subscriber, writing every event at `level` and above here.
    ///
    /// # Panics
    /// When a global subscriber is already set.
    pub fn install(level: tracing::Level) -> CapturedLogs {
        let logs = CapturedLogs::default();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_writer(logs.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other global tracing subscriber in this test binary");
        logs
    }

    /// Everything logged so far.
    pub fn text(&self) -> String {
        let bytes = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The lines logged so far that contain `needle`.
    pub fn lines_with(&self, needle: &str) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| l.contains(needle))
            .map(str::to_owned)
            .collect()
    }
}

impl std::io::Write for CapturedLogs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for CapturedLogs {
    type Writer = CapturedLogs;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

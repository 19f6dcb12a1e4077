//! What every test uses: the `fenced` command with a clean environment, a background
//! `fenced run` ([`Holder`]), bounded polling ([`eventually`]) and JSON readers.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use assert_cmd::Command;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Statuses documented in `fenced --help` and the README.
pub(crate) const NOT_ACQUIRED: i32 = 75;
pub(crate) const LOST: i32 = 76;
pub(crate) const USAGE: i32 = 2;
pub(crate) const UNAVAILABLE: i32 = 69;
/// force-release --expect-token: the holder has another token, or the key is free.
pub(crate) const REFUSED: i32 = 1;

/// The `fenced` binary's path.
pub(crate) fn fenced_bin() -> PathBuf {
    assert_cmd::cargo::cargo_bin("fenced")
}

/// `fenced` with a clean environment: no backend unless the test gives one.
pub(crate) fn fenced() -> Command {
    let mut c = Command::new(fenced_bin());
    c.env_remove("FENCED_URL")
        .env_remove("FENCED_FENCE_URL")
        .env_remove("FENCED_TOKEN")
        .env_remove("CONSUL_HTTP_ADDR")
        .env_remove("RUST_LOG")
        .timeout(Duration::from_secs(60));
    c
}

pub(crate) fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub(crate) fn assert_one_line(stderr: &str) {
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr:?}");
}

/// Polls `f` until it returns `Some` or `limit` passes.
pub(crate) fn eventually<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        // A poll interval; the condition is checked above.
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `fenced run` started in the background, whose child shell records its token and the
/// SIGTERM it gets in `dir`. Dropped: SIGTERM to `fenced` (forwarded to the child), then SIGKILL.
pub(crate) struct Holder {
    pub(crate) child: Option<Child>,
    dir: tempfile::TempDir,
}

/// The child: write the token, then idle (bounded, about 60 s) until SIGTERM, recorded.
const HOLDER_SCRIPT: &str = r#"trap 'echo term > "$DIR/term"; exit 143' TERM
echo "$FENCED_KEY $FENCED_TOKEN" > "$DIR/token.tmp" && mv "$DIR/token.tmp" "$DIR/token"
i=0; while [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done"#;

impl Holder {
    /// `fenced --url URL run KEY EXTRA... -- sh -c HOLDER_SCRIPT`, once the child has reported
    /// its token.
    pub(crate) fn start(url: &str, key: &str, extra: &[&str]) -> Holder {
        Self::start_script(url, key, extra, HOLDER_SCRIPT, &[])
    }

    /// Like [`Holder::start`] with another child script, which must write `$DIR/token` (as
    /// `"$FENCED_KEY $FENCED_TOKEN\n"`, atomically) once it runs; `env` is added to the child's.
    pub(crate) fn start_script(
        url: &str,
        key: &str,
        extra: &[&str],
        script: &str,
        env: &[(&str, &str)],
    ) -> Holder {
        let dir = tempfile::tempdir().unwrap();
        let out = fs::File::create(dir.path().join("run.out")).unwrap();
        let err = fs::File::create(dir.path().join("run.err")).unwrap();
        let child = std::process::Command::new(fenced_bin())
            .env_remove("FENCED_URL")
            .env_remove("FENCED_FENCE_URL")
            .env_remove("FENCED_TOKEN")
            .env_remove("RUST_LOG")
            .env("DIR", dir.path())
            .envs(env.iter().copied())
            .args(["--url", url, "run", key])
            .args(extra)
            .args(["--", "sh", "-c", script])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap();
        let mut h = Holder {
            child: Some(child),
            dir,
        };
        let token_file = h.path("token");
        let child = h.child.as_mut().unwrap();
        eventually(
            Duration::from_secs(20),
            "the child to report its token",
            || {
                if let Some(status) = child.try_wait().unwrap() {
                    panic!(
                        "fenced run exited early with {status}: {}",
                        fs::read_to_string(dir_err(&token_file)).unwrap_or_default()
                    );
                }
                fs::read_to_string(&token_file)
                    .ok()
                    .filter(|s| s.ends_with('\n'))
            },
        );
        h
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The PID of the `fenced run` process.
    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// `(key, token)` as the child saw them in `FENCED_KEY` and `FENCED_TOKEN`.
    pub(crate) fn seen(&self) -> (String, u64) {
        let s = fs::read_to_string(self.path("token")).unwrap();
        let (key, token) = s.trim().split_once(' ').expect("key and token");
        (key.to_owned(), token.parse().expect("a numeric token"))
    }

    pub(crate) fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let child = self.child.as_mut().unwrap();
        let status = eventually(limit, "fenced run to exit", || child.try_wait().unwrap());
        self.child = None;
        status
    }

    pub(crate) fn stderr(&self) -> String {
        fs::read_to_string(self.path("run.err")).unwrap_or_default()
    }
}

fn dir_err(token_file: &Path) -> PathBuf {
    token_file.with_file_name("run.err")
}

impl Drop for Holder {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // It may have been paused by the test: SIGCONT after SIGTERM (harmless otherwise).
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGCONT);
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `fenced inspect KEY --json` as `(status, value)`.
pub(crate) fn inspect_json(url: &str, key: &str) -> (i32, serde_json::Value) {
    json_of(&["--url", url, "inspect", key, "--json"])
}

/// `fenced ARGS` (which include `--json`) as `(status, value)`.
pub(crate) fn json_of(args: &[&str]) -> (i32, serde_json::Value) {
    let out = fenced().args(args).output().unwrap();
    let v = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("fenced {args:?} printed no JSON ({e}): {}", stderr_of(&out)));
    (out.status.code().expect("exited"), v)
}

/// Writes `value` under `token` through the fence at `fence_url`, from the test (as another
/// client would).
pub(crate) fn fence_write(fence_url: &str, resource: &str, token: u64, value: &'static [u8]) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let fence = fenced::connect_fence(fence_url).await.unwrap();
        let resource = fenced::ResourceId::new(resource).unwrap();
        let token = fenced::Token::new(token).unwrap();
        fence
            .write(&resource, token, fenced::Bytes::from_static(value))
            .await
            .unwrap();
    });
}

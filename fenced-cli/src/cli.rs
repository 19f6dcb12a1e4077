//! The command line, as clap parses it.

use std::ffi::OsString;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use fenced::Token;

/// The statuses every command that talks to a backend can end with, after its own.
macro_rules! backend_statuses {
    () => {
        "  2   usage or input error (the line names the bad value); nothing was sent
  69  the backend is unavailable (retry later)
  70  the backend's answer was unknown or unexpected (re-read before acting)
  74  the command ran but changed nothing, and its output could not be written (a
      command that took effect keeps its status and says so on stderr)
  78  the backend is misconfigured for fenced leases"
    };
}

/// Inspect, force-release and audit fenced leases, run commands under one, read and write
/// fenced resources, and work out the token floor after a restore.
///
/// The backend is chosen by URL: `--url`, else `FENCED_URL`, else Consul's own `CONSUL_HTTP_ADDR`
/// (with `CONSUL_HTTP_TOKEN`, `CONSUL_CACERT`, ...). Durations are written like `500ms`, `10s`,
/// `1m30s`. Errors are one line on stderr; see the exit statuses below.
#[derive(Debug, Parser)]
#[command(
    name = "fenced",
    version,
    after_help = "\
Exit statuses:
  0   success (inspect: the key is held; audit: records were listed;
      fence read: the resource has state; fence write: written;
      token-floor suggest: a floor was suggested)
  1   inspect: the key is free; audit: no forced release is recorded;
      fence read: nothing was ever accepted;
      force-release --expect-token: the holder has another token or the key is free
      (nothing was removed; what is there now is printed);
      token-floor suggest: no token was found to base a floor on
  2   usage or input error (bad argument, key, duration, URL or address); nothing was sent
  69  the backend is unavailable; run: the lease was in doubt when granted (not started)
  70  the backend's answer was unknown or unexpected (re-read before acting)
  74  the command ran but changed nothing (inspect, audit, fence read, token-floor
      suggest, a refused force-release), and its output could not be written (a full
      disk, an I/O error). force-release and fence write keep their own status and say so
      on stderr; a reader that closed the pipe keeps the command's own status
  75  run: the lock was not acquired within --wait
  76  run: the lease was lost while the command ran (the command was stopped, or it had
      finished and its release found the lease lost), or before it could start, or had
      no validity to spare (the command was not started);
      fence write: the token is stale (nothing was written)
  78  the backend is misconfigured for fenced leases
  126 run: the command could not be executed
  127 run: the command was not found
  128+N run: signal N killed the command
  run otherwise exits with the command's own status."
)]
pub(crate) struct Cli {
    /// Backend URL (redis://, etcd://, zk://, consul://, ...). Default: FENCED_URL, else
    /// consul:// when CONSUL_HTTP_ADDR is set.
    #[arg(
        long,
        global = true,
        env = "FENCED_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    pub(crate) url: Option<String>,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Show who holds KEY: owner, token, operation, time left. Exit 0 held, 1 free.
    ///
    /// Read-only: nothing is changed on the backend. `time left` is the coordinator's view of
    /// when it will expire the holder, not the holder's own (more conservative) validity.
    #[command(after_help = concat!(
        "Exit statuses:\n  0   the key is held\n  1   the key is free\n",
        backend_statuses!()
    ))]
    Inspect {
        /// The lock key (for example `jobs/nightly`).
        key: String,
        #[command(flatten)]
        output: Output,
    },
    /// Remove the lock on KEY whoever holds it; the actor and reason are recorded.
    ///
    /// The removed holder's lease is lost (at once where the backend can tell it, otherwise at
    /// its next renewal), and its token stays below every later token, so a fence rejects its
    /// writes once the next holder has claimed. Prints what was removed, or that the key was free.
    ///
    /// With --expect-token N (the token `inspect` showed), the holder is removed only if its
    /// token is still N: the backend compares and deletes in one atomic step, so a holder that
    /// arrived after `inspect` is never removed. Otherwise nothing is removed, what holds the key
    /// now is printed, and fenced exits 1.
    #[command(after_help = concat!(
        "Exit statuses:\n  0   removed (what was removed is printed), or the key was free\n",
        "  1   --expect-token: the holder has another token, or the key is free; nothing was\n",
        "      removed, what holds the key now is printed\n",
        backend_statuses!()
    ))]
    ForceRelease {
        /// The lock key.
        key: String,
        /// Who forces the release (required; recorded).
        #[arg(long, value_name = "NAME")]
        actor: Option<String>,
        /// Why (required; recorded).
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
        /// Remove the holder only if its fencing token is exactly N; otherwise remove nothing and
        /// exit 1.
        #[arg(long, value_name = "N", value_parser = token)]
        expect_token: Option<Token>,
        #[command(flatten)]
        output: Output,
    },
    /// List the forced releases of KEY, newest first. Exit 0, or 1 if none is recorded.
    ///
    /// One line per forced release: the time (RFC 3339, display only), the actor, the reason,
    /// and the removed holder's token and owner (`-` when the key was free). The format is the
    /// same on every backend. A force-release refused because of --expect-token removed nothing
    /// and is not listed.
    #[command(after_help = concat!(
        "Exit statuses:\n  0   records were listed\n  1   no forced release is recorded\n",
        backend_statuses!()
    ))]
    Audit {
        /// The lock key.
        key: String,
        /// How many records to show at most, newest first (1 to 100).
        #[arg(long, value_name = "N", default_value_t = 20)]
        limit: usize,
        #[command(flatten)]
        output: Output,
    },
    /// Run CMD while holding KEY, and stop it if the lease is lost.
    ///
    /// Acquires KEY (waiting up to --wait), keeps the lease renewed while CMD runs, and passes
    /// FENCED_TOKEN (the fencing token: carry it on every protected write) and FENCED_KEY to CMD.
    /// If the lease is lost, CMD gets SIGTERM and SIGCONT (so a stopped CMD acts on the SIGTERM
    /// too), then SIGKILL if it still runs after --grace, and fenced exits 76. Anything CMD writes
    /// after the loss carries the old token, which a fence rejects once a newer holder wrote.
    /// When CMD exits, the lease is released and fenced exits with CMD's status, or 76 if the
    /// release finds the lease already lost (a loss not yet noticed when CMD exited). SIGTERM and
    /// SIGHUP sent to fenced are forwarded to CMD; SIGINT is not (from a terminal CMD gets it
    /// directly). SIGTERM, SIGHUP or SIGINT ignored when fenced started (SIGHUP under nohup)
    /// stays ignored in fenced and CMD. Only CMD itself is signalled: a shell script should `exec` its last
    /// command or pass the signal on to its own children. A signal while fenced waits for KEY
    /// gives the wait up (128+N, CMD not started) after deleting its place in the queue.
    ///
    /// While fenced waits for KEY on a terminal (stderr is a tty), a spinner shows the wait;
    /// otherwise nothing is printed but errors.
    #[command(after_help = concat!(
        "Exit statuses:\n",
        "  N   CMD's own status when it exited under the lease (128+N if signal N killed it);\n",
        "      128+N also when signal N came while fenced waited for KEY: the wait was given\n",
        "      up and CMD was not started\n",
        "  69  also: the lease was in doubt when granted, and CMD was not started\n",
        "  75  the lock was not acquired within --wait (the holder is named when known)\n",
        "  76  the lease was lost while CMD ran; CMD was stopped (SIGTERM and SIGCONT, then\n",
        "      SIGKILL after --grace), or it had just exited and the release found the lease\n",
        "      lost; or it was lost before CMD could start, or granted with no more validity\n",
        "      than the margin (a tenth of the TTL), and CMD was not started\n",
        "  126 CMD could not be executed; 127 CMD was not found (the lease was released)\n",
        backend_statuses!()
    ))]
    Run(RunArgs),
    /// Work out the token floor to configure after restoring the coordinator from a backup.
    TokenFloor {
        #[command(subcommand)]
        command: TokenFloorCommand,
    },
    /// Read a fenced resource, or write to it under a fencing token.
    Fence {
        #[command(subcommand)]
        command: FenceCommand,
    },
}

#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    /// The lock key.
    pub(crate) key: String,
    /// The lease TTL asked for (the backend may round it up; see its minimum).
    #[arg(long, default_value = "10s", value_parser = duration, value_name = "DURATION")]
    pub(crate) ttl: Duration,
    /// How long to wait for the key to come free (0s: try once).
    #[arg(long, default_value = "30s", value_parser = duration, value_name = "DURATION")]
    pub(crate) wait: Duration,
    /// After the lease is lost: how long CMD has between SIGTERM and SIGKILL.
    #[arg(long, default_value = "5s", value_parser = duration, value_name = "DURATION")]
    pub(crate) grace: Duration,
    /// An operation name shown by `inspect` while CMD runs.
    #[arg(long, value_name = "NAME")]
    pub(crate) operation: Option<String>,
    /// Serve the library's metrics (Prometheus text format, on any path, e.g. `/metrics`) on
    /// ADDR (`127.0.0.1:9464`, `[::]:9464`) from before the acquisition until fenced exits:
    /// `fenced_leases_held`, `fenced_renew_seconds`, `fenced_leases_lost_total`, ... (see
    /// docs/metrics.md). The `_seconds` histograms have buckets, for `histogram_quantile`.
    #[arg(long, value_name = "ADDR")]
    pub(crate) metrics_addr: Option<std::net::SocketAddr>,
    /// The command and its arguments (after `--`).
    #[arg(required = true, num_args = 1.., last = true, value_name = "CMD")]
    pub(crate) command: Vec<OsString>,
}

#[derive(Debug, Subcommand)]
pub(crate) enum TokenFloorCommand {
    /// Suggest a token floor for KEY: one above the highest token any named fence accepted and
    /// the coordinator's current token for KEY.
    ///
    /// A coordinator restored from a backup (a Redis RDB/AOF, an etcd snapshot, a ZooKeeper or
    /// Consul snapshot) may hand out tokens again that fences already accepted, so a new
    /// holder's writes would be refused, or, worse, an old one's accepted. Configure the floor
    /// this prints (the `token_floor=N` option of the backend URL: every token is then above N)
    /// before any client acquires KEY again.
    ///
    /// Each --resource is read on each --fence (or on FENCED_FENCE_URL when no --fence is
    /// given); the coordinator's token comes from `inspect KEY` (none when KEY is free). Every
    /// number is printed with where it came from. Fence URLs are never printed: fences are
    /// named by their position on the command line. Exit 0 with a suggestion; 1 when no number
    /// was found (KEY is free and no fence accepted a token for the resources named).
    #[command(after_help = concat!(
        "Exit statuses:\n  0   a floor was suggested\n",
        "  1   no token was found (KEY is free and no fence accepted one for the resources)\n",
        backend_statuses!()
    ))]
    Suggest {
        /// The lock key whose tokens the fences carry.
        key: String,
        /// A fence to read (redis://, etcd://, postgres://, ...); repeat for several.
        #[arg(long = "fence", value_name = "URL")]
        fences: Vec<String>,
        /// A resource the holders of KEY write through the fences; repeat for several.
        #[arg(long = "resource", value_name = "RESOURCE")]
        resources: Vec<String>,
        #[command(flatten)]
        output: Output,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum FenceCommand {
    /// Show RESOURCE's newest accepted token and its last value. Exit 0, or 1 if the resource
    /// never accepted anything.
    ///
    /// The value is printed as text when it is UTF-8, otherwise as hex (`utf8` or `hex` in
    /// JSON). A resource that was claimed but never written shows its token and no value.
    #[command(after_help = concat!(
        "Exit statuses:\n  0   the resource has state\n  1   it never accepted a token\n",
        backend_statuses!()
    ))]
    Read {
        /// The resource id (for example `orders/42`).
        resource: String,
        /// The fence's URL (redis://, etcd://, postgres://, ...).
        #[arg(
            long,
            env = "FENCED_FENCE_URL",
            value_name = "URL",
            hide_env_values = true
        )]
        fence_url: Option<String>,
        #[command(flatten)]
        output: Output,
    },
    /// Write VALUE to RESOURCE under a fencing token, if no newer token was accepted there.
    ///
    /// The fence compares and writes in one atomic step: it accepts the write only if TOKEN is
    /// at least the newest token RESOURCE has accepted. Under `fenced run` the token is the
    /// lease's (FENCED_TOKEN), so `fenced run KEY -- sh -c 'fenced fence write R "$VALUE"'`
    /// writes only while no later holder of KEY has written or claimed R. Exit 0 when written;
    /// 76 when the token is stale (a newer holder wrote or claimed; nothing was written).
    #[command(after_help = concat!(
        "Exit statuses:\n  0   written\n",
        "  76  the token is stale: a newer holder wrote or claimed; nothing was written\n",
        backend_statuses!()
    ))]
    Write {
        /// The resource id (for example `orders/42`).
        resource: String,
        /// The value to write (UTF-8 text, stored as its bytes).
        value: String,
        /// The fencing token to write under. Default: FENCED_TOKEN, which `fenced run` sets.
        #[arg(
            long,
            env = "FENCED_TOKEN",
            value_name = "N",
            value_parser = token,
            hide_env_values = true
        )]
        token: Option<Token>,
        /// The fence's URL (redis://, etcd://, postgres://, ...).
        #[arg(
            long,
            env = "FENCED_FENCE_URL",
            value_name = "URL",
            hide_env_values = true
        )]
        fence_url: Option<String>,
        #[command(flatten)]
        output: Output,
    },
}

#[derive(Debug, Args, Clone, Copy)]
pub(crate) struct Output {
    /// Print one JSON object on stdout instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

/// A fencing token (`0..=9223372036854775807`).
fn token(s: &str) -> Result<Token, String> {
    s.parse::<Token>().map_err(|e| e.to_string())
}

/// A human duration (`10s`, `1m30s`, `250ms`).
fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("not a duration ({e}); write e.g. 10s, 1m30s, 250ms"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    /// Every command, subcommand and option has help, and every command that runs has its
    /// exit statuses listed.
    #[test]
    fn help_is_complete() {
        fn walk(cmd: &clap::Command, path: &str) {
            let path = format!("{path} {}", cmd.get_name());
            for arg in cmd.get_arguments() {
                if arg.get_id() == "help" || arg.get_id() == "version" {
                    continue;
                }
                assert!(
                    arg.get_help().is_some(),
                    "{path}: {} has no help",
                    arg.get_id()
                );
            }
            if cmd.get_name() == "help" {
                return;
            }
            assert!(cmd.get_about().is_some(), "{path} has no about");
            if cmd.get_subcommands().next().is_none() {
                let after = cmd
                    .get_after_help()
                    .map(|h| h.to_string())
                    .unwrap_or_default();
                assert!(
                    after.contains("Exit statuses:"),
                    "{path} lists no exit statuses"
                );
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &path);
            }
        }
        let mut cli = Cli::command();
        cli.build();
        walk(&cli, "");
    }

    #[test]
    fn durations_parse_in_human_form() {
        assert_eq!(duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(duration("10x").unwrap_err().contains("not a duration"));
    }

    #[test]
    fn tokens_parse_in_range_only() {
        assert_eq!(token("42").map(|t| t.get()), Ok(42));
        assert!(token("-1").unwrap_err().contains("out of range"));
        assert!(token("abc").is_err());
    }
}

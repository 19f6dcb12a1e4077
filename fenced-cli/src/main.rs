//! `fenced`: the operator and scripting command for fenced leases.
//!
//! `fenced` looks at and steers the locks that the `fenced` library keeps on Redis, etcd,
//! ZooKeeper or Consul, runs commands under such a lock (as `flock`, `consul lock` and
//! `etcdctl lock` do, but with a fencing token and a stop when the lease is lost), reads and
//! writes fenced resources, and works out the token floor after a restore. `fenced --help` and
//! `fenced <command> --help` document every option and exit status; `fenced-cli/README.md` has
//! the details per backend.
//!
//! | command | what it does | exit statuses of its own |
//! |---|---|---|
//! | `inspect KEY` | who holds KEY: owner, token, operation, time left | 0 held, 1 free |
//! | `force-release KEY --actor A --reason R [--expect-token N]` | removes the holder (with `--expect-token`, only if its token is N: compare-and-delete on the server); recorded | 0 removed or free, 1 refused |
//! | `audit KEY [--limit N]` | the forced releases, newest first | 0 listed, 1 none |
//! | `run KEY [--ttl] [--wait] [--grace] [--metrics-addr] -- CMD...` | CMD under a kept lease, `FENCED_TOKEN`/`FENCED_KEY` in its environment, stopped when the lease is lost | CMD's status, 75 not acquired, 76 lost, 126/127 |
//! | `fence read RESOURCE` | the newest accepted token and the last value | 0, 1 never written |
//! | `fence write RESOURCE VALUE [--token N]` | a fenced write (token default `FENCED_TOKEN`) | 0 written, 76 stale |
//! | `token-floor suggest KEY [--fence URL]... [--resource R]...` | the `token_floor` to configure after restoring the coordinator | 0, 1 nothing found |
//!
//! Every command but `run` (whose stdout is the command's) takes `--json` (one JSON object on
//! stdout). Errors are one line on stderr
//! (`fenced: ...`): 2 for bad input (nothing was sent), 69 unavailable, 70 unknown outcome, 74
//! output not written, 78 misconfigured backend.
//!
//! # An example session
//!
//! An operator and a nightly job on etcd (tokens on Redis are larger numbers; the shapes are the
//! same on every backend):
//!
//! ```text
//! $ export FENCED_URL=etcd://10.0.0.5:2379 FENCED_FENCE_URL=postgres://app@db/app
//! $ fenced inspect jobs/nightly; echo "exit $?"
//! key        jobs/nightly
//! backend    etcd
//! state      free
//! exit 1
//!
//! # The job: FENCED_TOKEN is the lease's token; `fence write` carries it.
//! $ fenced run jobs/nightly --ttl 10s --wait 1m --operation nightly -- \
//!       sh -c 'fenced fence write orders/42 paid && exec ./nightly.sh' &
//! written to orders/42 under token 41 (newest before: none)
//!
//! $ fenced inspect jobs/nightly
//! key        jobs/nightly
//! backend    etcd
//! state      held
//! holder     web-3/4121
//! token      41
//! operation  nightly
//! acquired   2026-12-01T02:00:00Z
//! time left  8s 996ms
//!
//! # A second copy does not get the lock.
//! $ fenced run jobs/nightly --wait 0s -- ./nightly.sh; echo "exit $?"
//! fenced: lock "jobs/nightly" was not acquired within 0ns (held by web-3/4121 with token 41)
//! exit 75
//!
//! # The job hangs: remove it, but only if it is still the holder that was inspected.
//! $ fenced force-release jobs/nightly --actor alice --reason "host lost" --expect-token 41
//! removed the holder of jobs/nightly on etcd
//! holder     web-3/4121
//! token      41
//! ...
//! # Meanwhile the job's fenced run stops its command and exits 76:
//! fenced: lease on "jobs/nightly" (token 41) is lost: revoked; the command was stopped with SIGTERM
//!
//! $ fenced audit jobs/nightly
//! 2026-12-01T02:17:40Z actor="alice" reason="host lost" removed_token=41 removed_owner="web-3/4121"
//!
//! # A late write of the old holder, after the next run wrote under token 57:
//! $ fenced fence write orders/42 late --token 41; echo "exit $?"
//! fenced: stale token for resource "orders/42": presented 41, newest accepted 57
//! exit 76
//! $ fenced fence read orders/42
//! resource   orders/42
//! newest     57
//! written by 57
//! value      shipped
//!
//! # After restoring etcd from an older snapshot: which floor to configure?
//! $ fenced token-floor suggest jobs/nightly --resource orders/42
//! key          jobs/nightly
//! coordinator  etcd: no current token (inspect jobs/nightly: free)
//! fence 1      postgres orders/42: newest accepted token 57
//! highest      57 (fence 1 (postgres), resource orders/42)
//! suggested    58
//! configure    token_floor=58 in the backend URL of every client of jobs/nightly, before any acquires it again
//! $ export FENCED_URL='etcd://10.0.0.5:2379?token_floor=58'
//! ```
//!
//! # `run` and a lost lease
//!
//! When the lease is lost (revoked, expired unrenewed, superseded), CMD gets SIGTERM and at once
//! SIGCONT, then SIGKILL if it still runs after `--grace` (5 s). SIGCONT makes a stopped CMD
//! (SIGSTOP, ^Z, a debugger, a frozen cgroup thawed) act on the SIGTERM within the grace like a
//! running one, as systemd does when it stops a unit; whatever it writes on its way out carries
//! the old token, which a fence rejects once the next holder has written or claimed. `fenced`
//! then exits 76; so it does when the command exits on its own and the release finds the lease
//! already lost (a loss not yet noticed). While `run` waits for the key on a terminal, a
//! spinner shows the wait; otherwise nothing is printed. `--metrics-addr ADDR` serves the
//! library's metrics (`fenced_*`, Prometheus text format) while the command runs.

#![forbid(unsafe_code)]

mod cli;
mod commands;
mod exit;
mod floor;
mod run;

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

use crate::cli::{Cli, Command, FenceCommand, TokenFloorCommand};
use crate::exit::Failure;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help and --version: clap prints them whole, on stdout, exit 0.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            // `fenced`, `fenced fence` or `fenced token-floor` alone: the command's help, whole
            // (its first line alone would name no command), on stderr, as a usage error.
            let _ = e.print();
            return ExitCode::from(exit::USAGE);
        }
        Err(e) if e.kind() == clap::error::ErrorKind::MissingSubcommand => {
            // The same with an option given (`fenced --url URL`, or FENCED_URL exported, which
            // clap counts as an argument): clap's error would be one line naming no command.
            eprint!("{}", missing_subcommand_help());
            return ExitCode::from(exit::USAGE);
        }
        Err(e) => {
            // A URL given where clap expected something else is quoted in its error: never
            // print its password or token.
            let line = exit::hide_urls(&exit::clap_one_line(&e.render().to_string()));
            let line = line.strip_prefix("error: ").unwrap_or(&line);
            report(&Failure::usage(line));
            return ExitCode::from(exit::USAGE);
        }
    };
    init_logging();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            report(&Failure::new(
                exit::SOFTWARE,
                format!("cannot start the runtime: {e}"),
            ));
            return ExitCode::from(exit::SOFTWARE);
        }
    };
    let status = runtime.block_on(dispatch(cli));
    // Background tasks (connections, keepers) end with the runtime; none may hold us up.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match status {
        Ok(code) => ExitCode::from(code),
        Err(failure) => {
            report(&failure);
            ExitCode::from(failure.status)
        }
    }
}

/// The whole help of the deepest command named on the command line (`fenced` itself when none
/// is): what a missing subcommand shows.
fn missing_subcommand_help() -> String {
    use clap::CommandFactory;
    let mut command = Cli::command();
    command.build();
    for arg in std::env::args_os().skip(1) {
        let Some(name) = arg.to_str() else { continue };
        match command.find_subcommand(name) {
            Some(sub) => command = sub.clone(),
            None => continue,
        }
    }
    command.render_help().to_string()
}

async fn dispatch(cli: Cli) -> Result<u8, Failure> {
    match cli.command {
        Command::Inspect { key, output } => commands::inspect(cli.url, &key, output).await,
        Command::ForceRelease {
            key,
            actor,
            reason,
            expect_token,
            output,
        } => commands::force_release(cli.url, &key, actor, reason, expect_token, output).await,
        Command::Audit { key, limit, output } => {
            commands::audit(cli.url, &key, limit, output).await
        }
        Command::Run(args) => run::run(cli.url, args).await,
        Command::TokenFloor {
            command:
                TokenFloorCommand::Suggest {
                    key,
                    fences,
                    resources,
                    output,
                },
        } => floor::suggest(cli.url, &key, fences, resources, output).await,
        Command::Fence {
            command:
                FenceCommand::Read {
                    resource,
                    fence_url,
                    output,
                },
        } => commands::fence_read(fence_url, &resource, output).await,
        Command::Fence {
            command:
                FenceCommand::Write {
                    resource,
                    value,
                    token,
                    fence_url,
                    output,
                },
        } => commands::fence_write(fence_url, &resource, value, token, output).await,
    }
}

/// Writes `fenced: <message>` on stderr, one line.
fn report(failure: &Failure) {
    let _ = writeln!(std::io::stderr().lock(), "fenced: {failure}");
}

/// Diagnostics from the library go to stderr only when `RUST_LOG` asks for them (for example
/// `RUST_LOG=fenced=debug,warn`): by default `fenced` prints nothing but its own output and errors.
fn init_logging() {
    if std::env::var_os("RUST_LOG").is_some_and(|v| !v.is_empty()) {
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .try_init();
    }
}

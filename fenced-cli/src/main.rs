//! `fenced`: the operator and scripting command for fenced leases (see the README).

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
        Err(e) => {
            let line = exit::clap_one_line(&e.render().to_string());
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

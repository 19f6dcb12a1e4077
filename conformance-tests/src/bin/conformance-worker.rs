//! A worker *process* for the conformance suite's fault cases: it acquires a lease from a
//! coordinator URL and writes through a remote fence, reporting each step on stdout so the test
//! can pause it (SIGSTOP), resume it (SIGCONT) or kill it (SIGKILL) at a known point.
//!
//! ```text
//! conformance-worker --coordinator URL --fence ADDR --key KEY --ttl-ms N
//!                    [--wait-ms N] [--writes N] [--interval-ms N]
//! ```
//!
//! Output lines: `ACQUIRED <token>`, `WRITE <i> OK`, `WRITE <i> STALE <current>`,
//! `WRITE <i> ERR <message>`, `RELEASE OK|LOST|ERR <message>`, `ERROR <message>`.

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use conformance_tests::fence_server::RemoteFence;
use lease_core::{Bytes, Error, Fence, LeaseOptions, LockKey, ResourceId};

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[derive(Default)]
struct Args {
    coordinator: String,
    fence: String,
    key: String,
    ttl_ms: u64,
    wait_ms: u64,
    writes: u64,
    interval_ms: u64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        wait_ms: 30_000,
        writes: 100,
        interval_ms: 20,
        ..Default::default()
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = || {
            v.parse::<u64>()
                .map_err(|_| format!("{flag} {v:?} is not a number"))
        };
        match flag.as_str() {
            "--coordinator" => a.coordinator = v.clone(),
            "--fence" => a.fence = v.clone(),
            "--key" => a.key = v.clone(),
            "--ttl-ms" => a.ttl_ms = num()?,
            "--wait-ms" => a.wait_ms = num()?,
            "--writes" => a.writes = num()?,
            "--interval-ms" => a.interval_ms = num()?,
            _ => return Err(format!("unknown flag {flag:?}")),
        }
    }
    if a.coordinator.is_empty() || a.fence.is_empty() || a.key.is_empty() || a.ttl_ms == 0 {
        return Err("--coordinator, --fence, --key and --ttl-ms are required".into());
    }
    Ok(a)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            say(format!("ERROR {e}"));
            return ExitCode::from(2);
        }
    };
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say(format!("ERROR {e}"));
            ExitCode::FAILURE
        }
    }
}

async fn run(a: Args) -> Result<(), Error> {
    let coord = fenced::connect(&a.coordinator).await?;
    let fence = RemoteFence::new(a.fence.parse().map_err(|_| {
        Error::InvalidInput(lease_core::InvalidInput::OutOfRange {
            field: "--fence",
            value: a.fence.clone(),
            expected: "host:port",
        })
    })?);
    let key: LockKey = a.key.parse()?;
    let resource = ResourceId::from(&key);
    let options =
        LeaseOptions::new(Duration::from_millis(a.ttl_ms)).wait(Duration::from_millis(a.wait_ms));
    let lease = coord.acquire(&key, &options).await?;
    let token = lease.token();
    fence.claim(&resource, token).await?;
    say(format!("ACQUIRED {token}"));
    for i in 0..a.writes {
        tokio::time::sleep(Duration::from_millis(a.interval_ms)).await;
        match fence
            .write(
                &resource,
                token,
                Bytes::from(format!("pid {} write {i}", std::process::id())),
            )
            .await
        {
            Ok(_) => say(format!("WRITE {i} OK")),
            Err(Error::Stale { current, .. }) => {
                say(format!("WRITE {i} STALE {current}"));
                break;
            }
            Err(e) => say(format!("WRITE {i} ERR {e}")),
        }
    }
    match lease.release().await {
        Ok(()) => say("RELEASE OK".into()),
        Err(Error::Lost { .. }) => say("RELEASE LOST".into()),
        Err(e) => say(format!("RELEASE ERR {e}")),
    }
    Ok(())
}

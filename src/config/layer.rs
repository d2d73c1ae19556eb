//! The precedence of settings (flag, environment, file, default) in one parse. Each of the
//! file's values becomes the default of the flag it sets, once that flag's own parser has
//! accepted it, so clap reads every setting once: from the flag, else its variable, else the
//! file, else the built-in default. The file's keys are checked against the commands' flags.

use super::keys::{check_keys, file_flags, FileFlag, FileKeys};
use super::{kafka_env_properties, scalar, ConfigFile, Env, CONFIG_ENV};
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::PathBuf;

/// Why a command line was not read: clap's own answer (help and the version included), or a
/// problem with the file or one of its values.
#[derive(Debug)]
pub enum LayerError {
    Clap(clap::Error),
    Config(anyhow::Error),
}

impl From<clap::Error> for LayerError {
    fn from(e: clap::Error) -> Self {
        Self::Clap(e)
    }
}

impl From<anyhow::Error> for LayerError {
    fn from(e: anyhow::Error) -> Self {
        Self::Config(e)
    }
}

impl std::fmt::Display for LayerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Clap(e) => f.write_str(&super::render_clap_error(e)),
            Self::Config(e) => write!(f, "{}", crate::secrets::scrub(&format!("{e:#}"))),
        }
    }
}

/// Where an effective setting came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Flag,
    Env(String),
    File,
    /// The file gives it, and its flag refused the value: the command will not start.
    Refused,
    Default,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Flag => f.write_str("flag"),
            Self::Env(name) => write!(f, "env {name}"),
            Self::File => f.write_str("file"),
            Self::Refused => f.write_str("file, refused (see the commands below)"),
            Self::Default => f.write_str("default"),
        }
    }
}

/// A command line read over the file and the environment.
#[derive(Debug)]
pub struct Layered {
    /// The matches of the whole command line.
    pub matches: ArgMatches,
    /// The subcommands it names, such as `["events", "list"]`.
    pub path: Vec<String>,
    /// The file it was read over.
    pub file: Option<ConfigFile>,
    /// The librdkafka properties of `[kafka]`, then of `REPLAYPROOF_KAFKA_*`: applied before the
    /// command's own `--kafka-option`s, so the last one set wins.
    pub properties: Vec<(String, String)>,
    /// The command's arguments whose default is the file's value.
    from_file: BTreeSet<String>,
    /// The file's values for this command that their flags refused.
    pub(crate) refused: Vec<Refused>,
}

/// A value of the file its flag refused.
#[derive(Debug, Clone)]
pub(crate) struct Refused {
    pub(crate) section: &'static str,
    pub(crate) key: String,
    /// The file, the key and the parser's reason, never the value.
    pub(crate) problem: String,
}

impl Layered {
    /// The matches of the command that runs.
    pub fn leaf(&self) -> &ArgMatches {
        let mut matches = &self.matches;
        while let Some((_, sub)) = matches.subcommand() {
            matches = sub;
        }
        matches
    }

    /// Where the value of `arg`, an argument of the command that runs, came from; None when
    /// it has none.
    pub fn source(&self, arg: &Arg) -> Option<Source> {
        let id = arg.get_id().as_str();
        Some(match self.leaf().value_source(id)? {
            ValueSource::CommandLine => Source::Flag,
            ValueSource::EnvVariable => {
                let name = arg.get_env().unwrap_or_default().to_string_lossy();
                Source::Env(name.into_owned())
            }
            ValueSource::DefaultValue if self.from_file.contains(id) => Source::File,
            _ => Source::Default,
        })
    }
}

/// Reads `argv` as the process runs it: the file (`--config` or [`CONFIG_ENV`]) loaded and its
/// keys checked, each of its values the default of its flag, and the command line parsed once.
pub fn layered(
    root: Command,
    keys: &FileKeys,
    argv: Vec<OsString>,
    env: &dyn Env,
) -> Result<Layered, LayerError> {
    let file = match config_path(&argv, env) {
        Some(p) => Some(ConfigFile::load(&p, env)?),
        None => None,
    };
    let layered = layered_over(root, keys, file, argv, env)?;
    match layered.refused.first() {
        Some(refused) => Err(LayerError::Config(anyhow::anyhow!("{}", refused.problem))),
        None => Ok(layered),
    }
}

/// [`layered`] over a file already read; a value of the file its flag refused is left out and
/// named in [`Layered::refused`] rather than failing the parse.
pub(crate) fn layered_over(
    root: Command,
    keys: &FileKeys,
    file: Option<ConfigFile>,
    argv: Vec<OsString>,
    env: &dyn Env,
) -> Result<Layered, LayerError> {
    let mut layer = FileLayer::new(root, keys, file.as_ref())?;
    let matches = layer.command.try_get_matches_from(argv)?;
    let mut path = Vec::new();
    let mut at = &matches;
    while let Some((name, sub)) = at.subcommand() {
        path.push(name.to_owned());
        at = sub;
    }
    let properties = properties(file.as_ref(), env);
    Ok(Layered {
        from_file: layer.from_file.remove(&path).unwrap_or_default(),
        refused: layer.refused.remove(&path).unwrap_or_default(),
        matches,
        path,
        file,
        properties,
    })
}

/// The librdkafka properties of `[kafka]`, then of `REPLAYPROOF_KAFKA_*`; the value of one
/// that names a secret is registered, so no log or error prints it.
fn properties(file: Option<&ConfigFile>, env: &dyn Env) -> Vec<(String, String)> {
    let from_file = file.into_iter().flat_map(ConfigFile::kafka_properties);
    let from_env = kafka_env_properties(env)
        .into_iter()
        .map(|p| (p.key, p.value));
    let all: Vec<_> = from_file.chain(from_env).collect();
    for (key, value) in &all {
        if crate::secrets::is_secret_property(key) {
            crate::secrets::register(value);
        }
    }
    all
}

/// The command tree with the file's values as its flags' defaults.
struct FileLayer {
    command: Command,
    /// For each command's path, the arguments whose default is now the file's value.
    from_file: BTreeMap<Vec<String>, BTreeSet<String>>,
    /// For each command's path, the file's values its flags refused.
    refused: BTreeMap<Vec<String>, Vec<Refused>>,
}

impl FileLayer {
    fn new(root: Command, keys: &FileKeys, file: Option<&ConfigFile>) -> anyhow::Result<Self> {
        let mut layer = Self {
            command: root.clone(),
            from_file: BTreeMap::new(),
            refused: BTreeMap::new(),
        };
        let Some(file) = file else {
            return Ok(layer);
        };
        check_keys(&root, keys, file)?;
        for flag in file_flags(&root, keys) {
            let Some(value) = file.section(flag.section).get(&flag.key).cloned() else {
                continue;
            };
            let cmd = leaf(&root, &flag.path);
            match file_default(cmd, &flag, &value, file) {
                Ok((id, texts)) => {
                    layer.command = at(layer.command, &flag.path, |c| {
                        c.mut_arg(&id, |a| {
                            // The file's value is no default to show in --help: it may be a
                            // secret. A switch (no value) shows none, and clap refuses to be
                            // told to hide it.
                            let hide = a.get_action().takes_values();
                            a.default_values(texts)
                                .required(false)
                                .hide_default_value(hide)
                        })
                    });
                    layer.from_file.entry(flag.path).or_default().insert(id);
                }
                Err(reason) => {
                    // Named when this command runs, rather than as a missing flag.
                    let id = flag.arg.get_id().as_str();
                    layer.command = at(layer.command, &flag.path, |c| {
                        c.mut_arg(id, |a| a.required(false))
                    });
                    let (path, section, key) = (file.path.display(), flag.section, flag.key);
                    let problem = format!("{path}: [{section}] {key}: {reason}");
                    let refused = Refused {
                        section,
                        key,
                        problem,
                    };
                    layer.refused.entry(flag.path).or_default().push(refused);
                }
            }
        }
        Ok(layer)
    }
}

/// `cmd` with `f` applied to its subcommand at `path`.
fn at(cmd: Command, path: &[String], f: impl FnOnce(Command) -> Command) -> Command {
    match path.split_first() {
        None => f(cmd),
        Some((first, rest)) => cmd.mut_subcommand(first, |sub| at(sub, rest, f)),
    }
}

/// The argument the file's `value` for `flag` sets, and its texts, each accepted by that
/// argument's own parser. A duration's old spelling (`lease_secs = 45`) sets the duration
/// (`--lease 45s`), so the two spellings are one setting.
fn file_default(
    cmd: &Command,
    flag: &FileFlag<'_>,
    value: &toml::Value,
    file: &ConfigFile,
) -> Result<(String, Vec<String>), String> {
    let texts = texts(flag.arg, value)?;
    check(flag.arg, &texts)?;
    let Some((new, unit)) = old_spelling(cmd, flag.arg) else {
        return Ok((flag.arg.get_id().to_string(), texts));
    };
    let new_key = new.get_long().unwrap_or_default().replace('-', "_");
    if file.section(flag.section).contains_key(&new_key) {
        return Err(format!(
            "the old spelling of `{new_key}`, which the file also gives; give one of them"
        ));
    }
    let texts: Vec<String> = texts.iter().map(|n| format!("{n}{unit}")).collect();
    check(new, &texts)?;
    Ok((new.get_id().to_string(), texts))
}

/// The duration that `arg` is the old `…-ms` or `…-secs` spelling of, with the unit its
/// numbers are in.
fn old_spelling<'c>(cmd: &'c Command, arg: &'c Arg) -> Option<(&'c Arg, &'static str)> {
    let long = arg.get_long()?;
    let unit = match () {
        _ if long.ends_with("-ms") => "ms",
        _ if long.ends_with("-secs") => "s",
        _ => return None,
    };
    let new = spellings(cmd, arg)
        .into_iter()
        .find(|a| a.get_id() != arg.get_id())?;
    (arg.is_hide_set() && !new.is_hide_set()).then_some((new, unit))
}

/// The file's `value` as the texts of `arg`'s values: a list's items, a table's `KEY=VALUE`
/// pairs, or one plain value.
fn texts(arg: &Arg, value: &toml::Value) -> Result<Vec<String>, String> {
    let many = matches!(arg.get_action(), ArgAction::Append);
    let texts = match value {
        toml::Value::Boolean(b) => vec![b.to_string()],
        _ if matches!(arg.get_action(), ArgAction::SetTrue) => {
            return Err("true or false is expected".into())
        }
        toml::Value::Array(items) if many => items
            .iter()
            .map(|item| scalar(item).ok_or("a list of plain values is expected"))
            .collect::<Result<_, _>>()?,
        toml::Value::Table(table) if many => table
            .iter()
            .map(|(k, v)| {
                let v = scalar(v).ok_or_else(|| format!("{k}: a plain value is expected"))?;
                Ok(format!("{k}={v}"))
            })
            .collect::<Result<_, String>>()?,
        toml::Value::Array(_) | toml::Value::Table(_) => {
            return Err("one plain value is expected".into())
        }
        other => vec![scalar(other).expect("not an array or a table")],
    };
    Ok(texts)
}

/// Whether `arg`'s own parser accepts every one of `texts`; the reason when it does not, which
/// never repeats the value (it may be a secret).
fn check(arg: &Arg, texts: &[String]) -> Result<(), String> {
    let probe = Arg::new("value")
        .long("value")
        .action(ArgAction::Append)
        .value_parser(arg.get_value_parser().clone());
    let probe = match arg.get_value_delimiter() {
        Some(d) => probe.value_delimiter(d),
        None => probe,
    };
    // `--value=TEXT`: a text that starts with a dash is still only a value.
    let argv = texts.iter().map(|t| format!("--value={t}"));
    let refused = Command::new("file")
        .no_binary_name(true)
        .arg(probe)
        .try_get_matches_from(argv)
        .err();
    match refused {
        None => Ok(()),
        Some(e) => Err(reason(&e)),
    }
}

/// What a value parser said, without the value.
fn reason(e: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue};
    use std::error::Error as _;
    if let Some(source) = e.source() {
        return crate::secrets::scrub(&source.to_string()).into_owned();
    }
    match e.get(ContextKind::ValidValue) {
        Some(ContextValue::Strings(valid)) => format!("expected one of {}", valid.join(", ")),
        _ => e.kind().to_string(),
    }
}

/// The command `path` names under `root`.
fn leaf<'a>(root: &'a Command, path: &[String]) -> &'a Command {
    path.iter().fold(root, |cmd, name| {
        cmd.find_subcommand(name)
            .expect("the path was read from this tree")
    })
}

/// The flags that spell the same setting as `arg`, `arg` included: a duration and its old
/// `…-ms` or `…-secs` spelling, which conflict with each other.
fn spellings<'c>(cmd: &'c Command, arg: &'c Arg) -> Vec<&'c Arg> {
    let mut all = vec![arg];
    all.extend(cmd.get_arg_conflicts_with(arg));
    let conflicting_with_it = cmd.get_arguments().filter(|other| {
        cmd.get_arg_conflicts_with(other)
            .iter()
            .any(|a| a.get_id() == arg.get_id())
    });
    all.extend(conflicting_with_it);
    all
}

/// Where the file is: `--config` in `argv`, or [`CONFIG_ENV`].
pub fn config_path(argv: &[OsString], env: &dyn Env) -> Option<PathBuf> {
    let mut tokens = argv.iter().skip(1);
    while let Some(token) = tokens.next() {
        let Some(text) = token.to_str() else { continue };
        if text == "--" {
            break;
        }
        if text == "--config" {
            return tokens.next().map(PathBuf::from);
        }
        if let Some(path) = text.strip_prefix("--config=") {
            return Some(PathBuf::from(path));
        }
    }
    env.var(CONFIG_ENV)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{parse, Args, Command as Cmd};
    use crate::config::ProcessEnv;

    /// `replayproof ARGV --config c.toml`, with the file `text`, as the process reads it.
    fn parsed(argv: &[&str], text: &str) -> Result<Args, LayerError> {
        let (_dir, argv) = crate::config::tests::with_file(argv, text);
        parse(argv, &ProcessEnv)
    }

    const CONSUME: &[&str] = &["consume", "--brokers=b", "--database-url=postgres://u@h/d"];
    const DISPATCH: &[&str] = &["dispatch", "--database-url=postgres://u@h/d"];

    fn refusal(argv: &[&str], text: &str) -> String {
        match parsed(argv, text) {
            Err(LayerError::Config(e)) => format!("{e:#}"),
            other => panic!("{argv:?} with {text:?}: {other:?}"),
        }
    }

    #[test]
    fn a_value_of_the_file_is_checked_by_its_flag_and_named_by_its_key() {
        let cases = [
            (
                CONSUME,
                "[consume]\nbatch_size = 0\n",
                "[consume] batch_size: ",
                "1..=100000",
            ),
            (
                CONSUME,
                "[consume]\nassignor = \"random\"\n",
                "[consume] assignor: ",
                "expected one of roundrobin, cooperative-sticky",
            ),
            (
                CONSUME,
                "[consume]\nmigrate = \"yes\"\n",
                "[consume] migrate: ",
                "true or false",
            ),
            (
                CONSUME,
                "[consume]\nbatch_size = [1, 2]\n",
                "batch_size: ",
                "one plain value",
            ),
            (
                DISPATCH,
                "[dispatch]\nlease = \"300\"\n",
                "[dispatch] lease: ",
                "such as 250ms",
            ),
            (
                DISPATCH,
                "[dispatch]\nlease = \"2m\"\nlease_secs = 45\n",
                "[dispatch] lease_secs: ",
                "the old spelling of `lease`",
            ),
            (
                DISPATCH,
                "[dispatch]\nlease_secs = 0\n",
                "[dispatch] lease_secs: ",
                "1..=",
            ),
        ];
        for (argv, text, key, reason) in cases {
            let error = refusal(argv, text);
            assert!(error.contains("c.toml: ") && error.contains(key), "{error}");
            assert!(error.contains(reason), "{error}");
        }
    }

    #[test]
    fn a_value_refused_by_one_command_stops_only_the_commands_that_read_it() {
        let text = "[consume]\nbatch_size = 0\n";
        assert!(refusal(CONSUME, text).contains("batch_size"));
        let dispatch = parsed(DISPATCH, text).expect("dispatch reads no [consume]");
        assert!(matches!(dispatch.command, Cmd::Dispatch(_)));
    }

    #[test]
    fn a_refused_secret_from_the_file_is_never_printed() {
        let secret = "hunter2-secret";
        let text = format!("[database]\nurl = \"postgres://u:{secret}@h/d?sslmode=bogus\"\n");
        let error = refusal(&["migrate"], &text);
        assert!(error.contains("[database] url: "), "{error}");
        assert!(!error.contains(secret), "{error}");
    }

    #[test]
    fn a_value_of_the_file_that_looks_like_a_flag_is_only_a_value() {
        let args = parsed(CONSUME, "[kafka]\ngroup = \"--blue\"\n").unwrap();
        let Cmd::Consume(consume) = args.command else {
            unreachable!("a consume command")
        };
        assert_eq!(consume.group, "--blue");
    }

    #[test]
    fn the_file_fills_a_required_flag_and_help_shows_none_of_its_values() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let text = format!(
            "[database]\nurl = \"postgres://u:pw-secret@h/d\"\n[dispatch]\nsigning_secret = \"{secret}\"\nlease = \"17m\"\n"
        );
        let args = parsed(&["dispatch"], &text).expect("the file gives the database URL");
        let Cmd::Dispatch(dispatch) = args.command else {
            unreachable!("a dispatch command")
        };
        assert_eq!(dispatch.settings(None).unwrap().lease.as_secs(), 17 * 60);
        let Err(LayerError::Clap(help)) = parsed(&["dispatch", "--help"], &text) else {
            panic!("help is clap's answer")
        };
        let help = help.render().to_string();
        assert!(help.contains("--signing-secret"), "{help}");
        for hidden in [secret, "pw-secret", "17m"] {
            assert!(!help.contains(hidden), "{hidden} in {help}");
        }
    }

    #[test]
    fn database_shards_are_the_database_urls_in_order_and_exclude_url() {
        // The file's list becomes `--database-url` repeated (the process's own DATABASE_URL,
        // read by clap, would win over the file, so the file is read here as the layer reads it).
        let text =
            "[database]\nshards = [\"postgres://u@a/x\", \"postgres://u@b/y\"]\nbuckets = 256\n";
        let file =
            ConfigFile::parse(std::path::Path::new("c.toml"), text, &BTreeMap::new()).unwrap();
        let urls = file.section("database")["url"].clone();
        assert_eq!(
            urls.as_array()
                .unwrap()
                .iter()
                .map(|u| u.as_str().unwrap())
                .collect::<Vec<_>>(),
            ["postgres://u@a/x", "postgres://u@b/y"]
        );
        let both = "[database]\nurl = \"postgres://u@a/x\"\nshards = [\"postgres://u@b/y\"]\n";
        let err = ConfigFile::parse(std::path::Path::new("c.toml"), both, &BTreeMap::new())
            .unwrap_err()
            .to_string();
        assert!(err.contains("gives both url and shards"), "{err}");
        // On the command line, the flag repeated, in order, over the environment.
        let args = parsed(
            &[
                "dispatch",
                "--database-url=postgres://u@a/x",
                "--database-url=postgres://u@b/y",
            ],
            "[database]\nbuckets = 256\n",
        )
        .unwrap();
        let Cmd::Dispatch(dispatch) = args.command else {
            unreachable!("a dispatch command")
        };
        let urls: Vec<&str> = dispatch
            .database
            .database_url
            .iter()
            .map(|u| u.expose())
            .collect();
        assert_eq!(urls, ["postgres://u@a/x", "postgres://u@b/y"]);
        assert_eq!(dispatch.database.buckets, 256);
    }
}

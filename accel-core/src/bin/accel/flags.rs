//! `accel launch`'s flag for every setting (`--strategy`, `--accumulate`, `--cpu`, ...),
//! made from the settings' table (`accel_core::config::SETTINGS`), as the configuration
//! itself is: a flag per row, its help the row's first line, its value checked as the
//! program will read it. A `true`/`false` setting is a switch (`--cpu`), or takes its value
//! after `=` (`--cpu=false`).

use accel_core::config::{Literal, PartialConfig, SETTINGS};
use clap::{Arg, ArgAction, ArgMatches, Args, Command, FromArgMatches};

/// The settings given on the command line, by name, as written.
#[derive(Debug, Clone, Default)]
pub struct SettingFlags(Vec<(&'static str, String)>);

impl SettingFlags {
    /// These settings, as a configuration (each checked when its flag was parsed).
    pub fn config(&self) -> accel_core::Result<PartialConfig> {
        let mut config = PartialConfig::default();
        for (name, text) in &self.0 {
            config.set(name, text, &format!("--{}", name.replace('_', "-")))?;
        }
        Ok(config)
    }
}

fn flag(name: &str) -> String {
    name.replace('_', "-")
}

impl Args for SettingFlags {
    fn augment_args(mut command: Command) -> Command {
        for setting in SETTINGS {
            let parse = setting.parse;
            let mut arg = Arg::new(setting.name)
                .long(flag(setting.name))
                .help(format!("{} Passed as {}.", setting.summary(), setting.env))
                .action(ArgAction::Set)
                .value_parser(move |s: &str| parse(s).map(|_| s.to_owned()));
            arg = match setting.literal {
                Literal::Bool => arg
                    .num_args(0..=1)
                    .require_equals(true)
                    .default_missing_value("true")
                    .value_name("BOOL"),
                Literal::Integer => arg.value_name("N"),
                Literal::Number => arg.value_name("X"),
                Literal::Choice { names, list: false } => arg.value_name(names.join("|")),
                Literal::Choice { list: true, .. } => arg.value_name("LIST"),
                Literal::Text => arg.value_name("TEXT"),
            };
            command = command.arg(arg);
        }
        command
    }

    fn augment_args_for_update(command: Command) -> Command {
        Self::augment_args(command)
    }
}

impl FromArgMatches for SettingFlags {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut given = Vec::new();
        for setting in SETTINGS {
            if let Some(text) = matches.get_one::<String>(setting.name) {
                given.push((setting.name, text.clone()));
            }
        }
        Ok(Self(given))
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

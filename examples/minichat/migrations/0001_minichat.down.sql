DROP TABLE minichat_usage_records;
DROP TABLE minichat_turns;
DROP TABLE minichat_chats;
DROP TABLE minichat_quotas;
